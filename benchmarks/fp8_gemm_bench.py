"""FP8 linear microbenchmark: the block-scaled FP8 kernels (metrale/kernels/fp8_gemm.py, fp8_gemv.py,
fp8_quant.py) against torch's bf16 matmul, at Qwen3-8B's projection shapes.

For each shape and M it times, as the median over replays of a CUDA graph holding `--calls`
back-to-back calls (divided by `--calls`; calls cycle through enough weight copies to overflow L2,
so small-M calls stream their weight from HBM):
  bf16        F.linear with a bf16 weight (cuBLAS)
  fp8_linear  the dispatcher the layers call, activation groups of 128 (GEMV at M <= 4, else
              quantize + W8A8 GEMM)
  gemv        fp8_gemv_triton (M <= 4): the default config (fp8_gemv_config) and GEMV_GRID
  quant       quantize_activation_triton alone (M > 4)
  w8a8        fp8_gemm_triton on pre-quantized x: the default config (fp8_gemm_config) and
              the candidates of M's bucket (GEMM_CANDIDATES)
  w8a16       fp8_gemm_triton on bf16 x: likewise
Weights are random, quantized in [128, 128] blocks (as Qwen3-8B-FP8 ships them). Each Triton
result is checked against fp8_linear_reference. Prints a markdown table (us; effective TB/s =
the op's minimal bytes: weight + scales + x + y, once; TFLOP/s = 2 M N K / t), then per M bucket
of fp8_gemm_config's tables (per M for the GEMV) the config whose time, relative to the best
seen at each shape and M, sums least over the bucket: the rows to copy into fp8_gemm_config's
tables / fp8_gemv_config. Writes no files.

    PYTHONPATH=. python3 benchmarks/fp8_gemm_bench.py [--shapes qkv,down] [--m 1,16,256] [--default-only]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gemv_bench's timing helpers

# name -> (N, K): Qwen3-8B (hidden 4096, 32 q + 8 kv heads of 128, intermediate 12288)
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
M_VALUES = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
GROUP = 128  # weight blocks [GROUP, GROUP], activation groups of GROUP

# Tried after the default for M's bucket (the upper M of each fp8_gemm_config table row):
# (block_m, block_n, block_k, group_m, num_warps, num_stages). W8A16 tries each with block_k 64
# as well. Configs the GPU cannot hold (shared memory) are skipped at launch.
GEMM_CANDIDATES = {
    16: [(16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 6), (16, 128, 128, 1, 4, 4), (32, 64, 128, 1, 4, 4),
         (64, 64, 128, 1, 4, 4), (16, 32, 128, 1, 2, 5)],
    64: [(64, 64, 128, 1, 4, 5), (64, 128, 128, 8, 4, 4), (32, 64, 128, 1, 4, 4), (64, 32, 128, 1, 4, 4)],
    256: [(128, 128, 128, 8, 8, 4), (64, 64, 128, 8, 4, 4), (128, 64, 128, 8, 4, 4), (64, 256, 128, 8, 8, 3)],
    None: [(128, 128, 128, 8, 8, 3), (128, 256, 128, 8, 8, 3), (64, 128, 128, 8, 4, 4), (128, 128, 128, 1, 8, 4),
           (256, 128, 128, 8, 8, 3), (128, 128, 128, 16, 8, 4)],
}
# (block_n, block_k, num_warps, num_stages) for M <= 4, the chunk capped at K.
GEMV_GRID = [(1, 4096, 8, 1), (2, 4096, 8, 1), (4, 4096, 8, 1), (2, 8192, 8, 1), (2, 2048, 4, 1), (4, 2048, 4, 1),
             (4, 2048, 4, 3), (4, 1024, 2, 3), (4, 512, 1, 3), (8, 2048, 4, 1), (8, 1024, 2, 3)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from: " + ", ".join(SHAPES))
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma-separated row counts")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per CUDA graph")
    p.add_argument("--replays", type=int, default=20, help="timed graph replays (the median is kept)")
    p.add_argument("--max-configs", type=int, default=8, help="configs tried per kernel, default included")
    p.add_argument("--default-only", action="store_true", help="time only bf16, fp8_linear and the defaults")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s and s not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}: use {', '.join(SHAPES)}")
    args.shapes = [s for s in args.shapes.split(",") if s]
    try:
        args.m = [int(v) for v in args.m.split(",") if v]
    except ValueError:
        p.error(f"--m: expected comma-separated integers, got {args.m!r}")
    if not args.m or min(args.m) < 1 or min(args.calls, args.replays, args.max_configs) < 1:
        p.error("--m values, --calls, --replays and --max-configs must be positive")
    return args


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def bucket(M, fp8_gemm):
    """The fp8_gemm_config table row (its upper M; None for the last) that M falls in."""
    return next(upper for upper, _ in fp8_gemm._W8A8_TABLE if upper is None or M <= upper)


def bucket_label(M, fp8_gemm):
    upper = bucket(M, fp8_gemm)
    return f"M<={upper}" if upper is not None else f"M>{fp8_gemm._W8A8_TABLE[-2][0]}"


def gemm_configs(fp8_gemm, M, N, K, w8a8, max_configs):
    """The default config first (None: the no-override path), then M's bucket's candidates."""
    default = fp8_gemm.fp8_gemm_config(M, N, K, w8a8)
    out = [None]
    for c in GEMM_CANDIDATES[bucket(M, fp8_gemm)]:
        for block_k in ((c[2],) if w8a8 else (c[2], 64)):
            cfg = fp8_gemm.Fp8GemmConfig(*c)._replace(block_k=block_k)
            if cfg != default and cfg not in out:
                out.append(cfg)
    return out[:max_configs]


def gemv_configs(fp8_gemv, M, N, K, max_configs):
    default = fp8_gemv.fp8_gemv_config(M, N, K)
    k_cap = max(16, 1 << (K - 1).bit_length())
    out = [None]
    for bn, bk, nw, ns in GEMV_GRID:
        bk = min(bk, k_cap)
        cfg = fp8_gemv.Fp8GemvConfig(bn, bk, max(1, min(nw, bk // 512)), ns)
        if cfg != default and cfg not in out:
            out.append(cfg)
    return out[:max_configs]


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_gemm_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)
        return 0
    from gemv_bench import copy_bandwidth, time_graph

    from metrale.kernels import HAS_TRITON
    from metrale.kernels import fp8_gemm, fp8_gemv
    from metrale.kernels.fp8_linear import fp8_linear
    from metrale.kernels.fp8_quant import quantize_activation_triton
    from metrale.kernels import fp8_math

    if not HAS_TRITON:
        print("fp8_gemm_bench.py needs triton (not importable); nothing measured.", file=sys.stderr)
        return 0
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"# {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB; device-to-device copy "
          f"{copy_bandwidth() / 1e12:.2f} TB/s; {args.calls} calls per graph, median of {args.replays} replays; "
          f"[{GROUP}, {GROUP}] weight blocks, activation groups of {GROUP}\n")
    print("| shape | N | K | M | kernel | config | us | TB/s | TFLOP/s | vs bf16 |")
    print("|---|---:|---:|---:|---|---|---:|---:|---:|---:|")
    results = {}  # (kernel, bucket) -> {config: {(shape, M): us}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        N, K = SHAPES[name]
        w_bf16 = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(torch.bfloat16)
        w_q, w_s = fp8_math.quantize_weight(w_bf16, GROUP, GROUP)
        copies = max(1, min(args.calls, math.ceil(4 * l2 / (N * K))))  # > 4x L2 of fp8 weights in flight
        fp8_ws = [(w_q.clone(), w_s.clone()) for _ in range(copies)]
        bf16_ws = [w_bf16.clone() for _ in range(max(1, min(args.calls, math.ceil(4 * l2 / (2 * N * K)))))]
        w_bytes, s_bytes = N * K, 4 * w_s.numel()
        for M in args.m:
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            x_q, x_s = quantize_activation_triton(x, GROUP)
            flops, out_bytes, x_bytes = 2 * M * N * K, 2 * M * N, 2 * M * K

            def report(kernel, cfg, us, nbytes, t_bf16):
                label = "default" if cfg is None else "/".join(map(str, cfg))
                tbs = nbytes / (us * 1e-6) / 1e12
                print(f"| {name} | {N} | {K} | {M} | {kernel} | {label} | {us:.2f} | {tbs:.2f} "
                      f"| {flops / (us * 1e-6) / 1e12:.1f} | {t_bf16 / us:.2f}x |", flush=True)

            t_bf16 = time_graph(lambda i: F.linear(x, bf16_ws[i % len(bf16_ws)]), args.calls, args.replays)
            report("bf16", None, t_bf16, 2 * N * K + x_bytes + out_bytes, t_bf16)
            t = time_graph(lambda i: fp8_linear(x, *fp8_ws[i % copies], GROUP, GROUP, activation_group=GROUP),
                           args.calls, args.replays)
            report("fp8_linear", None, t, w_bytes + s_bytes + x_bytes + out_bytes, t_bf16)

            runs = []  # (kernel, configs, call, reference, bytes)
            if M <= fp8_gemv.MAX_M:
                runs.append(("gemv", gemv_configs(fp8_gemv, M, N, K, args.max_configs),
                             lambda i, c: fp8_gemv.fp8_gemv_triton(x, *fp8_ws[i % copies], GROUP, GROUP, config=c),
                             fp8_math.fp8_linear_reference(x, w_q, w_s, GROUP, GROUP),
                             w_bytes + s_bytes + x_bytes + out_bytes))
            else:
                t = time_graph(lambda i: quantize_activation_triton(x, GROUP), args.calls, args.replays)
                report("quant", None, t, x_bytes + M * K + 4 * x_s.numel(), t_bf16)
            runs.append(("w8a8", gemm_configs(fp8_gemm, M, N, K, True, args.max_configs),
                         lambda i, c: fp8_gemm.fp8_gemm_triton(x_q, x_s, *fp8_ws[i % copies], GROUP, GROUP, GROUP,
                                                               out_dtype=torch.bfloat16, config=c),
                         fp8_math.fp8_linear_reference(x, w_q, w_s, GROUP, GROUP, activation_group=GROUP),
                         w_bytes + s_bytes + M * K + 4 * x_s.numel() + out_bytes))
            runs.append(("w8a16", gemm_configs(fp8_gemm, M, N, K, False, args.max_configs),
                         lambda i, c: fp8_gemm.fp8_gemm_triton(x, None, *fp8_ws[i % copies], GROUP, GROUP, None,
                                                               config=c),
                         fp8_math.fp8_linear_reference(x, w_q, w_s, GROUP, GROUP),
                         w_bytes + s_bytes + x_bytes + out_bytes))
            for kernel, configs, call, ref, nbytes in runs:
                for cfg in configs[:1] if args.default_only else configs:
                    try:
                        us = time_graph(lambda i, c=cfg: call(i, c), args.calls, args.replays)
                        torch.testing.assert_close(call(0, cfg).float(), ref.float(), rtol=2e-2, atol=2e-2)
                    except Exception as e:  # e.g. triton's OutOfResources for a config this GPU cannot hold
                        _log(f"{name} M={M} {kernel} {cfg}: skipped ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]})")
                        continue
                    report(kernel, cfg, us, nbytes, t_bf16)
                    key = (kernel, f"M={M}" if kernel == "gemv" else bucket_label(M, fp8_gemm))
                    default = (fp8_gemv.fp8_gemv_config(M, N, K) if kernel == "gemv"
                               else fp8_gemm.fp8_gemm_config(M, N, K, kernel == "w8a8"))
                    results.setdefault(key, {}).setdefault(cfg or default, {})[(name, M)] = us
        del fp8_ws, bf16_ws
        torch.cuda.empty_cache()
    print()
    summarize(results)
    _log(f"done in {time.time() - t_start:.0f} s")
    return 0


def summarize(results):
    """Per (kernel, M bucket; the GEMV per M, as fp8_gemv_config's rules are): the config with the
    least summed time relative to the best seen at each (shape, M), among configs measured at
    every (shape, M) of the bucket."""
    for (kernel, label), by_cfg in results.items():
        points = {p for times in by_cfg.values() for p in times}
        best_at = {p: min(t[p] for t in by_cfg.values() if p in t) for p in points}
        common = {c: t for c, t in by_cfg.items() if set(t) == points}
        if not common:
            print(f"winner {kernel} {label}: none (no config was measured at every shape/M point)")
            continue
        win = min(common, key=lambda c: sum(common[c][p] / best_at[p] for p in points))
        slack = max(common[win][p] / best_at[p] for p in points)
        print(f"winner {kernel} {label}: {tuple(win)}  (within {100 * (slack - 1):.0f}% of the best at every "
              f"one of {len(points)} shape/M points)")


if __name__ == "__main__":
    sys.exit(main())
