"""Small-batch MoE decode microbenchmark: the routed experts of one layer through the small-batch
GEMVs (metrale/kernels/moe_gemv.py, `fused_experts_small_batch_triton`) against the grouped GEMM
(metrale/layers/moe/triton_moe.py, `fused_experts_triton`), at decode batch sizes.

Shapes (one layer's routed experts, bf16 by default; shared experts and the router are not timed):

    qwen3-30b-a3b       128 experts, top-8,  hidden 2048, expert intermediate 768
    qwen3-next-80b-a3b  512 experts, top-10, hidden 2048, expert intermediate 512

Routing is random (softmax over random logits, top-k, renormalised, rounded to the model dtype),
a different draw for every call. Each figure is the median over replays of a CUDA graph holding
`--calls` back-to-back calls (launch gaps as in the engine's graph replay), divided by `--calls`.
The bytes a call must move are the weights of the distinct experts its routing touches,
distinct x 3 x hidden x intermediate x element size (activations are negligible); achieved GB/s
is those bytes over the time, and `floor` is the time at the device-to-device copy bandwidth
measured at start. With --ep N only rank 0's share of the experts (E / N) is held, as under
expert parallelism; assignments to the other ranks' experts cost nothing. --sweep also times a
few alternative configs of the small-batch path (one stage changed at a time) and prints the
best. Prints a markdown table; writes no files.

    PYTHONPATH=. python3 benchmarks/moe_decode_bench.py [--models qwen3-next-80b-a3b] [--batch 1,2,4,8,16] [--sweep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

# name -> (experts, top_k, hidden, expert intermediate)
MODELS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# --sweep: alternatives to the default config, as field overrides (one stage at a time).
SWEEP = [
    dict(block_i=2), dict(block_i=4), dict(warps1=4), dict(block_i=2, warps1=4),
    dict(block_n=2), dict(block_n=4), dict(warps2=2), dict(warps2=8), dict(block_n=2, warps2=8),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated names from: " + ", ".join(MODELS) + " (or ExKxHxI: experts, top-k, "
                        "hidden, intermediate)")
    p.add_argument("--batch", default="1,2,4,8,16", help="comma-separated token counts")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks: time rank 0's share of the experts")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per CUDA graph")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays (the median is kept)")
    p.add_argument("--sweep", action="store_true", help="also time alternative small-batch configs")
    args = p.parse_args(argv)
    models = []
    for name in filter(None, args.models.split(",")):
        if name in MODELS:
            models.append((name, *MODELS[name]))
            continue
        try:
            experts, top_k, hidden, inter = (int(v) for v in name.lower().split("x"))
        except ValueError:
            p.error(f"unknown model {name!r}: use one of {', '.join(MODELS)} or ExKxHxI")
        if not 0 < top_k <= experts or hidden < 1 or inter < 1:
            p.error(f"{name!r}: need 0 < top-k <= experts and positive sizes")
        models.append((name, experts, top_k, hidden, inter))
    if not models:
        p.error("--models: nothing to run")
    args.models = models
    try:
        args.batch = [int(v) for v in args.batch.split(",") if v]
    except ValueError:
        p.error(f"--batch: expected comma-separated integers, got {args.batch!r}")
    if not args.batch or any(b < 1 for b in args.batch):
        p.error("--batch: each value must be positive")
    if args.calls < 1 or args.replays < 1:
        p.error("--calls and --replays must be positive")
    if args.ep < 1 or any(experts % args.ep for _, experts, *_ in models):
        p.error(f"--ep {args.ep}: must be positive and divide every model's expert count")
    return args


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_decode_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)
        return 1
    from metrale.kernels import HAS_TRITON

    if not HAS_TRITON:
        print("moe_decode_bench.py needs triton (not importable); nothing measured.", file=sys.stderr)
        return 1
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemv_bench import copy_bandwidth, time_graph  # this directory's GEMV benchmark: the same timing
    from metrale.kernels import moe_gemv
    from metrale.layers.moe import select_experts
    from metrale.layers.moe.triton_moe import fused_experts_triton

    t_start = time.time()
    dtype = DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"# {props.name}, {props.multi_processor_count} SMs; device-to-device copy: {bw / 1e12:.2f} TB/s; "
          f"dtype {args.dtype}; ep {args.ep} (rank 0); {args.calls} calls per graph, median of {args.replays} "
          f"replays\n")

    rows, sweeps = [], []
    for name, experts, top_k, hidden, inter in args.models:
        num_local = experts // args.ep
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = torch.empty(num_local, 2 * inter, hidden, dtype=dtype, device="cuda").normal_(0, 0.02, generator=gen)
        w2 = torch.empty(num_local, hidden, inter, dtype=dtype, device="cuda").normal_(0, 0.02, generator=gen)
        expert_bytes = 3 * hidden * inter * elem
        default_cfg = moe_gemv.moe_gemv_config(hidden, inter, top_k, dtype)
        _log(f"{name}: {num_local} local experts of {experts}, top-{top_k}, hidden {hidden}, intermediate {inter}, "
             f"{(w13.numel() + w2.numel()) * elem / 1e9:.2f} GB of weights; default {default_cfg}")
        for batch in args.batch:
            xs, routes, touched = [], [], []
            for _ in range(args.calls):
                xs.append(torch.randn(batch, hidden, device="cuda", generator=gen).to(dtype))
                weights, ids = select_experts(torch.randn(batch, experts, device="cuda", generator=gen), top_k)
                routes.append((weights.to(dtype), ids))
                touched.append(ids[ids < num_local].unique().numel())  # rank 0 holds experts [0, num_local)
            nbytes = statistics.mean(touched) * expert_bytes

            def small(i, cfg=None):
                return moe_gemv.fused_experts_small_batch_triton(xs[i], w13, w2, *routes[i], 0, config=cfg)

            def grouped(i):
                return fused_experts_triton(xs[i], w13, w2, *routes[i], 0)

            torch.testing.assert_close(small(0), grouped(0), rtol=2e-2, atol=2e-2)
            t_small = time_graph(small, args.calls, args.replays)
            t_grouped = time_graph(grouped, args.calls, args.replays)
            rows.append((name, batch, statistics.mean(touched), nbytes, t_small, t_grouped))
            _log(f"  batch {batch}: small-batch {t_small:.1f} us, grouped GEMM {t_grouped:.1f} us")
            if args.sweep:
                results = {default_cfg: t_small}
                for override in SWEEP:
                    cfg = default_cfg._replace(**override)
                    if cfg in results:
                        continue
                    try:
                        torch.testing.assert_close(small(0, cfg), grouped(0), rtol=2e-2, atol=2e-2)
                        results[cfg] = time_graph(lambda i, cfg=cfg: small(i, cfg), args.calls, args.replays)
                        _log(f"    {cfg}: {results[cfg]:.1f} us")
                    except Exception as e:  # e.g. triton's OutOfResources
                        _log(f"    {cfg}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                best = min(results, key=results.get)
                sweeps.append((name, batch, best, results[best], t_small, best == default_cfg))
        del w13, w2
        torch.cuda.empty_cache()

    print("| model | batch | distinct experts | weight MB | floor us | small-batch us | GB/s | % of copy "
          "| grouped GEMM us | GB/s | % of copy | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, batch, distinct, nbytes, t_s, t_g in rows:
        floor = nbytes / bw * 1e6
        print(f"| {name} | {batch} | {distinct:.1f} | {nbytes / 1e6:.1f} | {floor:.1f} | {t_s:.1f} "
              f"| {nbytes / t_s / 1e3:.0f} | {100 * floor / t_s:.0f}% | {t_g:.1f} | {nbytes / t_g / 1e3:.0f} "
              f"| {100 * floor / t_g:.0f}% | {t_g / t_s:.2f}x |")
    for name, batch, best, t_best, t_default, is_default in sweeps:
        print(f"sweep {name} batch {batch}: best {best} {t_best:.1f} us"
              + (" (the default)" if is_default else f" (default {t_default:.1f} us)"))
    _log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
