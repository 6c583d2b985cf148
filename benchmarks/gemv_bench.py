"""Tiny-M GEMV microbenchmark: the Triton kernel (metrale/kernels/gemv.py) against cuBLAS (F.linear).

For each decode shape of Qwen3-8B (and its tp=2 halves) and M in (1, 2, 4), times cuBLAS, the
Triton kernel at its default config (`gemv_config`) and a small grid of alternative configs. Each
figure is the median over replays of a CUDA graph holding `--calls` back-to-back calls (launch gaps
as in the engine's graph replay), divided by `--calls`. The calls cycle through enough copies of the
weight to overflow L2, so every call streams its weight from HBM as a decoder layer does. Bandwidth
is reported as a percentage of a device-to-device copy measured at start. Prints a markdown table
and one `winner` line per shape (the config with the least total time over the M values), then
exits; it writes no files.

    PYTHONPATH=. python3 benchmarks/gemv_bench.py [--shapes qkv,down] [--m 1,2,4] [--default-only]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

# name -> (N, K): Qwen3-8B (hidden 4096, 32 q + 8 kv heads of 128, intermediate 12288, vocab 151936)
SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
    "qkv_tp2": (3072, 4096),
    "o_proj_tp2": (4096, 2048),
    "gate_up_tp2": (12288, 4096),
    "down_tp2": (4096, 6144),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help="comma-separated names from: " + ", ".join(SHAPES) + " (or NxK, e.g. 4096x4096)")
    p.add_argument("--m", default="1,2,4", help="comma-separated row counts, each 1..4 (the GEMV's MAX_M)")
    p.add_argument("--configs", default=None,
                   help="replace the grid: comma-separated block_n/row-bytes-per-chunk/num_warps/num_stages, "
                        "e.g. 1/8192/8/1,2/8192/8/1")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per CUDA graph")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays (the median is kept)")
    p.add_argument("--max-configs", type=int, default=16, help="configs tried per shape, default included")
    p.add_argument("--default-only", action="store_true", help="time only cuBLAS and the default config")
    p.add_argument("--compile-workers", type=int, default=8,
                   help="processes that compile the Triton variants ahead of timing (0: compile inline)")
    args = p.parse_args(argv)
    shapes = []
    for name in filter(None, args.shapes.split(",")):
        if name in SHAPES:
            shapes.append((name, *SHAPES[name]))
        else:
            try:
                n, k = (int(v) for v in name.lower().split("x"))
            except ValueError:
                p.error(f"unknown shape {name!r}: use one of {', '.join(SHAPES)} or NxK")
            shapes.append((name, n, k))
    args.shapes = shapes
    try:
        args.m = [int(v) for v in args.m.split(",") if v]
    except ValueError:
        p.error(f"--m: expected comma-separated integers, got {args.m!r}")
    if not args.m or any(not 1 <= m <= 4 for m in args.m):
        p.error("--m: each value must be in 1..4")
    try:
        args.configs = None if args.configs is None else \
            [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",")]
    except ValueError:
        p.error(f"--configs: expected bn/bytes/warps/stages,..., got {args.configs!r}")
    if args.configs is not None and any(len(c) != 4 for c in args.configs):
        p.error("--configs: each entry is block_n/row-bytes-per-chunk/num_warps/num_stages")
    if args.calls < 1 or args.replays < 1 or args.max_configs < 1 or args.compile_workers < 0:
        p.error("--calls, --replays and --max-configs must be positive, --compile-workers >= 0")
    return args


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def time_graph(fn, calls, replays):
    """Median microseconds per call of fn(i), i = 0..calls-1, captured back to back in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (and Triton compilation) outside the capture
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    del graph
    return ms * 1000.0 / calls


def copy_bandwidth(nbytes=1 << 30, reps=20):
    """Bytes/s of a device-to-device copy (read + write counted), median over reps."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


# Tried after the default, in this order, until --max-configs: (block_n, bytes of a weight row per
# chunk, num_warps, num_stages). A first H200 run found block_n 4 best everywhere, plain loads
# (num_stages 1) best at M=1 and a cp.async ring (3) at M >= 2, with narrower chunks/fewer warps
# as M grows, so the grid is dense there and sparse elsewhere.
GRID = [
    (4, 2048, 4, 1), (4, 2048, 4, 3), (4, 1024, 2, 1), (4, 1024, 2, 3), (4, 512, 1, 1), (4, 512, 1, 3),
    (4, 2048, 4, 2), (4, 2048, 4, 4), (4, 4096, 8, 1),
    (2, 2048, 4, 1), (2, 2048, 4, 3), (2, 1024, 2, 3),
    (8, 2048, 4, 1), (8, 2048, 4, 3), (8, 1024, 2, 3),
    (16, 2048, 4, 1),
    # whole 8 KiB rows in one chunk (every load of a program issued at once), wider programs
    (1, 8192, 8, 1), (2, 8192, 8, 1), (4, 8192, 8, 1), (8, 8192, 8, 1), (4, 4096, 8, 1), (8, 4096, 8, 1),
    (8, 4096, 4, 1), (16, 1024, 2, 1), (8, 2048, 4, 2), (2, 4096, 4, 1),
]


def candidate_configs(gemv_mod, N, K, dtype, max_configs, grid=None):
    """The M=1 default first, then `grid` (default GRID), pruned to valid configs (every warp along K, the
    shared-memory ring within budget, the chunk no wider than K), at most max_configs."""
    elem = torch.empty((), dtype=dtype).element_size()
    vec = 16 // elem
    out = [gemv_mod.gemv_config(1, N, K, dtype)]
    for bn, chunk_bytes, nw, ns in grid or GRID:
        bk = chunk_bytes // elem
        nw = max(1, min(nw, bk // (vec * 32)))  # warps along K only (see the kernel's docstring)
        c = gemv_mod.GemvConfig(bn, bk, nw, ns)
        smem = bn * bk * elem * ns if ns > 1 else 0
        if c not in out and bk <= max(triton_next_pow2(K), 16) and smem <= 160 * 1024:
            out.append(c)
    return out[:max_configs]


def triton_next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def fits_registers(c, M, vec):
    """Rough per-thread fp32 registers (accumulators + one weight tile): skip hopeless spills."""
    threads = 32 * c.num_warps
    return M * c.block_n * c.block_k / vec / threads + c.block_n * c.block_k / threads <= 192


def _compile_one(job):
    """Worker: compile one (M, config) variant by running it once at a small N with the real K
    (same specializations as the timed call), filling Triton's on-disk cache for the parent."""
    M, K, dtype_name, kw = job
    from metrale.kernels.gemv import gemv_triton

    dtype = DTYPES[dtype_name]
    try:
        gemv_triton(torch.zeros(M, K, dtype=dtype, device="cuda"), torch.zeros(256, K, dtype=dtype, device="cuda"), **kw)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported again (and skipped) when the parent times it
        return f"{type(e).__name__}"


def precompile(jobs, workers):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as ex:
        failed = sum(r is not None for r in ex.map(_compile_one, jobs))
    _log(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s ({failed} failed)")


def fmt_cfg(c):
    return f"block_n={c.block_n} block_k={c.block_k} num_warps={c.num_warps} num_stages={c.num_stages}"


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)
        return 1
    from metrale.kernels import HAS_TRITON, gemv as gemv_mod, skinny_gemm as skinny

    if not HAS_TRITON:
        print("gemv_bench.py needs triton (not importable); nothing measured.", file=sys.stderr)
        return 1

    t_start = time.time()
    dtype = DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    vec = 16 // elem
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    bw = copy_bandwidth()
    print(f"# {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB; "
          f"device-to-device copy: {bw / 1e12:.2f} TB/s; dtype {args.dtype}; "
          f"{args.calls} calls per graph, median of {args.replays} replays\n")

    plan = []
    for name, N, K in args.shapes:
        configs = [gemv_mod.gemv_config(1, N, K, dtype)] if args.default_only else \
            candidate_configs(gemv_mod, N, K, dtype, args.max_configs, args.configs)
        plan.append((name, N, K, configs))
    if args.compile_workers > 0:
        jobs = []
        for _, N, K, configs in plan:
            for M in args.m:
                default = gemv_mod.gemv_config(M, N, K, dtype)
                for c in dict.fromkeys([default, *configs]):
                    if c == default or fits_registers(c, M, vec):
                        # dedupe on what the kernel specializes on: M, the config, whether K % block_k == 0
                        jobs.append((M, K if K % c.block_k else c.block_k * max(1, 4096 // c.block_k),
                                     args.dtype, tuple(sorted(c._asdict().items()))))
        precompile([(M, K, d, dict(kw)) for M, K, d, kw in dict.fromkeys(jobs)], args.compile_workers)

    rows, winners = [], []
    for name, N, K, configs in plan:
        wbytes = N * K * elem
        copies = min(args.calls, max(1, math.ceil(4 * l2 / wbytes)))  # > 4x L2 in flight: HBM reads
        gen = torch.Generator(device="cuda").manual_seed(0)
        weights = [(torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(dtype) for _ in range(copies)]
        _log(f"{name} N={N} K={K}: {copies} weight copies, {len(configs)} configs")
        shape_results = {}
        for M in args.m:
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            ref = F.linear(x, weights[0])
            t_cublas = time_graph(lambda i: F.linear(x, weights[i % copies]), args.calls, args.replays)
            t_skinny = math.nan
            if M >= skinny.MIN_M:  # the tensor-core kernel the layers take at 2..16 rows, at its default
                t_skinny = time_graph(lambda i: skinny.skinny_gemm_triton(x, weights[i % copies]),
                                      args.calls, args.replays)
            default = gemv_mod.gemv_config(M, N, K, dtype)
            results = {}
            for c in dict.fromkeys([default, *configs]):
                if c != default and not fits_registers(c, M, vec):
                    continue
                kw = {} if c == default else c._asdict()  # the default through the no-override path
                try:
                    results[c] = time_graph(lambda i, kw=kw: gemv_mod.gemv_triton(x, weights[i % copies], **kw),
                                            args.calls, args.replays)
                    torch.testing.assert_close(gemv_mod.gemv_triton(x, weights[0], **kw), ref, rtol=2e-2, atol=2e-2)
                    _log(f"    M={M} {fmt_cfg(c)}: {results[c]:.2f} us" + (" (default)" if c == default else ""))
                except Exception as e:  # e.g. triton's OutOfResources for a config this GPU cannot hold
                    results.pop(c, None)
                    _log(f"  M={M} {fmt_cfg(c)}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
            best = min(results, key=results.get)
            shape_results[M] = (t_cublas, results)
            rows.append((name, N, K, M, wbytes, t_cublas, t_skinny, default, results.get(default, math.nan), best, results[best]))
            _log(f"  M={M}: cuBLAS {t_cublas:.2f} us, skinny {t_skinny:.2f} us, default {rows[-1][8]:.2f} us, "
                 f"best {results[best]:.2f} us "
                 f"({fmt_cfg(best)})")
        # the config with the least total time over the M values (among those measured at every M)
        common = [c for c in dict.fromkeys(c for _, res in shape_results.values() for c in res)
                  if all(c in res for _, res in shape_results.values())]
        if common:
            win = min(common, key=lambda c: sum(res[c] for _, res in shape_results.values()))
            winners.append((name, N, K, win, [(M, res[win], t_cb) for M, (t_cb, res) in shape_results.items()]))
        del weights
        torch.cuda.empty_cache()

    def pct(t, nbytes):
        return 100.0 * nbytes / (t * 1e-6) / bw

    print("| shape | N | K | M | weight MB | cuBLAS us | skinny us | GEMV default us | best config (bn/bk/warps/stages) "
          "| best us | cuBLAS %BW | skinny %BW | default %BW | best %BW | best vs cuBLAS |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, N, K, M, wbytes, t_cb, t_sk, dflt, t_d, best, t_b in rows:
        cfg_s = f"{best.block_n}/{best.block_k}/{best.num_warps}/{best.num_stages}" + (" (default)" if best == dflt else "")
        print(f"| {name} | {N} | {K} | {M} | {wbytes / 1e6:.1f} | {t_cb:.2f} | {t_sk:.2f} | {t_d:.2f} | {cfg_s} "
              f"| {t_b:.2f} | {pct(t_cb, wbytes):.0f}% | {pct(t_sk, wbytes):.0f}% | {pct(t_d, wbytes):.0f}% "
              f"| {pct(t_b, wbytes):.0f}% | {t_cb / t_b:.2f}x |")
    print()
    for name, N, K, win, per_m in winners:
        times = ", ".join(f"M={M} {t:.2f} us (cuBLAS {t_cb:.2f})" for M, t, t_cb in per_m)
        print(f"winner {name} N={N} K={K}: {fmt_cfg(win)}  [{times}]")
    _log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
