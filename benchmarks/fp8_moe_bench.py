"""FP8 MoE microbenchmark: one layer's routed experts with FP8 block-scaled weights against bf16 weights.

Paths timed at each token count (one layer's routed experts; the router and shared experts are not
timed):

    bf16 gemv         metrale/kernels/moe_gemv.py          fused_experts_small_batch_triton
    bf16 grouped      metrale/layers/moe/triton_moe.py     fused_experts_triton
    fp8 gemv          metrale/kernels/fp8_moe_gemv.py      W8A16, fused_experts_fp8_small_batch_triton
    fp8 W8A8          metrale/kernels/fp8_moe_gemm.py      grouped, activations quantized per 128
    fp8 W8A16         metrale/kernels/fp8_moe_gemm.py      grouped, activations in bf16

The GEMV paths are timed up to --gemv-max tokens (beyond it they re-read every expert once per
token and only take long). `dispatch` names the path `fused_experts_fp8` takes at that size.

Shape: Qwen3-30B-A3B by default (128 experts, top-8, hidden 2048, expert intermediate 768, bf16
activations, FP8 weights in [128, 128] blocks quantized from the bf16 ones). Routing is random
(softmax over random logits, top-k, renormalised), a different draw for every call. Each figure
is the median over replays of a CUDA graph holding `--calls` back-to-back calls, timed with CUDA
events, divided by `--calls` (so every path is also checked to be graph-capturable). The bytes a
call must read are the weights of the distinct experts its routing touches: distinct x 3 x hidden
x intermediate x 2 (bf16) or x 1 plus the block scales (fp8); TB/s is those bytes over the time.
Before timing, each fp8 path's first call is checked against `fused_experts_fp8_reference`.
Prints a markdown table; writes no files.

    PYTHONPATH=. python3 benchmarks/fp8_moe_bench.py [--tokens 1,2,4,8,16,64,256,1024,4096] [--shape 128x8x2048x768]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

TOKENS = "1,2,4,8,16,64,256,1024,4096"
BLOCK = 128
ACTIVATION_GROUP = 128
PATHS = ("bf16 gemv", "bf16 grouped", "fp8 gemv", "fp8 W8A8", "fp8 W8A16")
GEMV_PATHS = ("bf16 gemv", "fp8 gemv")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=TOKENS, help="comma-separated token counts")
    p.add_argument("--shape", default="128x8x2048x768", help="ExKxHxI: experts, top-k, hidden, intermediate "
                                                              "(hidden and intermediate multiples of 128)")
    p.add_argument("--gemv-max", type=int, default=64, help="time the GEMV paths up to this many tokens")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per CUDA graph")
    p.add_argument("--replays", type=int, default=20, help="timed graph replays (the median is kept)")
    args = p.parse_args(argv)
    try:
        args.tokens = [int(v) for v in args.tokens.split(",") if v]
        args.experts, args.top_k, args.hidden, args.inter = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        p.error(f"--tokens: comma-separated integers; --shape: ExKxHxI (got {args.tokens!r}, {args.shape!r})")
    if not args.tokens or any(t < 1 for t in args.tokens):
        p.error("--tokens: each value must be positive")
    if not 0 < args.top_k <= args.experts or args.hidden % BLOCK or args.inter % BLOCK:
        p.error(f"--shape {args.shape}: need 0 < top-k <= experts, hidden and intermediate multiples of {BLOCK}")
    if args.calls < 1 or args.replays < 1:
        p.error("--calls and --replays must be positive")
    return args


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def quantized_experts(w: torch.Tensor):
    """bf16 [E, N, K] -> (float8_e4m3fn [E, N, K], float32 scales [E, N / 128, K / 128])."""
    from metrale.kernels.fp8_math import quantize_weight

    experts, n, k = w.shape
    q, scale = quantize_weight(w.reshape(experts * n, k), BLOCK, BLOCK)  # blocks never cross experts
    return q.view(experts, n, k), scale.view(experts, n // BLOCK, k // BLOCK)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_moe_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)
        return 0
    from metrale.kernels import HAS_TRITON

    if not HAS_TRITON:
        print("fp8_moe_bench.py needs triton (not importable); nothing measured.", file=sys.stderr)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemv_bench import copy_bandwidth, time_graph  # this directory's GEMV benchmark: the same timing
    from metrale.kernels.fp8_moe_gemm import fused_experts_fp8_triton
    from metrale.kernels.fp8_moe_gemv import fused_experts_fp8_small_batch_triton
    from metrale.kernels.moe_gemv import fused_experts_small_batch_triton, use_small_batch
    from metrale.layers.moe import select_experts
    from metrale.layers.moe.fp8_experts import fused_experts_fp8_reference
    from metrale.layers.moe.triton_moe import fused_experts_triton

    t_start = time.time()
    experts, top_k, hidden, inter = args.experts, args.top_k, args.hidden, args.inter
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs; device-to-device copy: {copy_bandwidth() / 1e12:.2f} "
          f"TB/s; {experts} experts, top-{top_k}, hidden {hidden}, intermediate {inter}; bf16 activations, FP8 "
          f"[{BLOCK}, {BLOCK}] blocks; {args.calls} calls per graph, median of {args.replays} replays\n")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=gen)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=gen)
    (q13, s13), (q2, s2) = quantized_experts(w13), quantized_experts(w2)
    fp8 = (q13, q2, s13, s2, BLOCK, BLOCK, BLOCK)
    bf16_bytes = 3 * hidden * inter * 2
    fp8_bytes = 3 * hidden * inter + (s13[0].numel() + s2[0].numel()) * 4

    paths = {
        "bf16 gemv": lambda x, w, i: fused_experts_small_batch_triton(x, w13, w2, w, i),
        "bf16 grouped": lambda x, w, i: fused_experts_triton(x, w13, w2, w, i),
        "fp8 gemv": lambda x, w, i: fused_experts_fp8_small_batch_triton(x, *fp8, w, i),
        "fp8 W8A8": lambda x, w, i: fused_experts_fp8_triton(x, *fp8, w, i, 0, ACTIVATION_GROUP),
        "fp8 W8A16": lambda x, w, i: fused_experts_fp8_triton(x, *fp8, w, i),
    }
    check_group = {"fp8 gemv": None, "fp8 W8A8": ACTIVATION_GROUP, "fp8 W8A16": None}
    rows = []
    for tokens in args.tokens:
        xs, routes, touched = [], [], []
        for _ in range(args.calls):
            xs.append(torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16())
            weights, ids = select_experts(torch.randn(tokens, experts, device="cuda", generator=gen), top_k)
            routes.append((weights.bfloat16(), ids))
            touched.append(ids.unique().numel())
        distinct = statistics.mean(touched)
        times = {}
        for name, fn in paths.items():
            if name in GEMV_PATHS and tokens > args.gemv_max:
                continue
            if name in check_group:
                expected = fused_experts_fp8_reference(xs[0], *fp8, *routes[0], 0, check_group[name]).float()
                error = ((fn(xs[0], *routes[0]).float() - expected).norm() / expected.norm()).item()
                assert error < 2e-2, f"{name} at {tokens} tokens: relative error {error:.3g} against the reference"
            times[name] = time_graph(lambda i, fn=fn: fn(xs[i], *routes[i]), args.calls, args.replays)
        dispatch = "fp8 gemv" if use_small_batch(tokens, inter) else "fp8 W8A8 (grouped)"
        rows.append((tokens, distinct, times, dispatch))
        _log(f"  {tokens} tokens ({distinct:.1f} experts): " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()))

    print("| tokens | distinct experts | " + " | ".join(f"{name} us (TB/s)" for name in PATHS)
          + " | fp8 dispatch | best fp8 / best bf16 |")
    print("|---:|---:|" + "---:|" * len(PATHS) + "---|---:|")
    for tokens, distinct, times, dispatch in rows:
        cells = []
        for name in PATHS:
            if name not in times:
                cells.append("-")
                continue
            nbytes = distinct * (bf16_bytes if name.startswith("bf16") else fp8_bytes)
            cells.append(f"{times[name]:.1f} ({nbytes / times[name] / 1e6:.2f})")
        best_fp8 = min(t for k, t in times.items() if k.startswith("fp8"))
        best_bf16 = min(t for k, t in times.items() if k.startswith("bf16"))
        print(f"| {tokens} | {distinct:.1f} | " + " | ".join(cells) + f" | {dispatch} | {best_fp8 / best_bf16:.2f} |")
    _log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
