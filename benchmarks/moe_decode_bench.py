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

# --sweep: each stage timed alone over a grid of its config fields (chunk widths capped by the
# dimension; `unrolled` only with several chunks), then both stages' best together.
SWEEP_GATE_UP = [dict(block_i=bi, warps1=w) for bi in (1, 2, 4) for w in (4, 8)]
SWEEP_DOWN = ([dict(block_n=1, warps2=4, block_k2=256, unrolled=False, per_assignment=False)]  # the first rule's
              + [dict(block_n=bn, warps2=w, block_k2=bk, unrolled=True, per_assignment=pa)
                 for pa, blocks in ((False, (4, 8)), (True, (8, 16, 32))) for bn in blocks
                 for w in (4, 8) for bk in (128, 256)])
DOWN_FIELDS = ("block_n", "warps2", "block_k2", "unrolled", "per_assignment")


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
    p.add_argument("--programmatic-launch", action=argparse.BooleanOptionalAction, default=True,
                   help="launch with programmatic dependent launch where the GPU has it, as the engine does "
                        "(default on: a config's speed without it does not predict the engine's)")
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


def _fields(cfg, names):
    return " ".join(f"{n}={getattr(cfg, n)}" for n in names)


def sweep(args, small, grouped, xs, routes, w13, w2, default_cfg, inter, hidden, top_k):
    """Each stage alone over its grid, then the two best stages together:
    ((gate_up default us, best us, fields), (down ...), both best us, default us)."""
    from gemv_bench import time_graph
    from metrale.kernels import moe_gemv

    def stage_grid(grid, run, names, limit):
        results = {}
        for override in grid:
            cfg = default_cfg._replace(**override)
            width = cfg.block_k1 if "block_i" in override else cfg.block_k2
            if cfg.unrolled and width >= limit:
                continue  # unrolling one chunk is the plain loop
            if cfg in results:
                continue
            try:
                results[cfg] = time_graph(lambda i, cfg=cfg: run(i, cfg), args.calls, args.replays)
                _log(f"    {_fields(cfg, names)}: {results[cfg]:.1f} us")
            except Exception as e:  # e.g. triton's OutOfResources
                _log(f"    {_fields(cfg, names)}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        best = min(results, key=results.get)
        return time_graph(lambda i: run(i, default_cfg), args.calls, args.replays), results[best], best

    acts = [torch.empty((x.shape[0] * top_k, inter), dtype=x.dtype, device=x.device) for x in xs]
    outs = [torch.empty_like(x) for x in xs]
    for i, x in enumerate(xs):  # stage 2's inputs, from the default stage 1
        moe_gemv.launch_gate_up(x, w13, routes[i][1], acts[i], 0, default_cfg)

    def gate_up(i, cfg):
        moe_gemv.launch_gate_up(xs[i], w13, routes[i][1], acts[i], 0, cfg)

    def down(i, cfg):
        moe_gemv.launch_down(acts[i], w2, routes[i][1], routes[i][0], outs[i], 0, cfg)

    g = stage_grid(SWEEP_GATE_UP, gate_up, ("block_i", "warps1", "block_k1", "unrolled"), hidden)
    d = stage_grid(SWEEP_DOWN, down, DOWN_FIELDS, inter)
    both = default_cfg._replace(block_i=g[2].block_i, warps1=g[2].warps1, block_k1=g[2].block_k1,
                                **{f: getattr(d[2], f) for f in DOWN_FIELDS})
    # `unrolled` is one flag for both stages: keep it where the best down wanted it (down has several chunks)
    both = both._replace(unrolled=d[2].unrolled or g[2].unrolled)
    torch.testing.assert_close(small(0, both), grouped(0), rtol=2e-2, atol=2e-2)
    t_both = time_graph(lambda i: small(i, both), args.calls, args.replays)
    t_default = time_graph(lambda i: small(i), args.calls, args.replays)
    _log(f"  both best {both}: {t_both:.1f} us (default {t_default:.1f})")
    return (g[0], g[1], _fields(g[2], ("block_i", "warps1", "block_k1", "unrolled"))), \
        (d[0], d[1], _fields(d[2], DOWN_FIELDS)), t_both, t_default


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_decode_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)
        return 1
    from metrale.kernels import HAS_TRITON, programmatic_launch_supported, set_programmatic_launch

    if not HAS_TRITON:
        print("moe_decode_bench.py needs triton (not importable); nothing measured.", file=sys.stderr)
        return 1
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemv_bench import copy_bandwidth, time_graph  # this directory's GEMV benchmark: the same timing
    from metrale.kernels import moe_gemv
    from metrale.layers.moe import select_experts
    from metrale.layers.moe.triton_moe import fused_experts_triton

    t_start = time.time()
    pdl = args.programmatic_launch and programmatic_launch_supported(torch.device("cuda"))
    set_programmatic_launch(pdl)
    dtype = DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"# {props.name}, {props.multi_processor_count} SMs; device-to-device copy: {bw / 1e12:.2f} TB/s; "
          f"dtype {args.dtype}; ep {args.ep} (rank 0); programmatic launch {'on' if pdl else 'off'}; {args.calls} calls per graph, median of {args.replays} "
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
                sweeps.append((name, batch, *sweep(args, small, grouped, xs, routes, w13, w2, default_cfg, inter,
                                                   hidden, top_k)))
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
    if sweeps:
        print("\n| model | batch | gate_up default us | best | config | down default us | best | config "
              "| both best us | default both us |")
        print("|---|---:|---:|---:|---|---:|---:|---|---:|---:|")
    for name, batch, (g_def, g_best, g_cfg), (d_def, d_best, d_cfg), t_both, t_default in sweeps:
        print(f"| {name} | {batch} | {g_def:.1f} | {g_best:.1f} | {g_cfg} | {d_def:.1f} | {d_best:.1f} | {d_cfg} "
              f"| {t_both:.1f} | {t_default:.1f} |")
    _log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
