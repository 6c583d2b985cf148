"""A probe: the skinny GEMM (kernels/skinny_gemm.py) with its weight and x tiles loaded by TMA
(Hopper tensor descriptors: `tma=True`, the MET_SKINNY_TMA switch) over a grid of launch
configs, against the default kernel (cp.async pointer loads), the one-row GEMV and cuBLAS on
Qwen3-8B's projections at the row counts of batch-1 verify steps.
The question it answers: does TMA close the gap between the skinny GEMM at 2..5 rows and the
GEMV at one row (docs/benchmarks.md: o_proj 11.8 against 9.6 us, qkv 15.2 against 13.3)?
Timing as benchmarks/skinny_gemm_bench.py (CUDA-graph replays, weights streamed from HBM).

    PYTHONPATH=. python3 benchmarks/skinny_tma_probe.py [--m 2,5]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/skinny_tma_probe.py --check-only   # CPU
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 12288), "gate_up": (24576, 4096)}
# (block_n, block_k, num_warps, num_stages)
GRID = [(16, 256, 2, 4), (32, 256, 4, 4), (16, 256, 4, 6), (32, 128, 4, 6), (64, 128, 4, 4),
        (16, 128, 2, 8), (32, 256, 4, 6), (64, 256, 4, 3), (128, 128, 4, 3)]


def skinny_tma(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int,
               num_stages: int) -> torch.Tensor:
    """The library's TMA kernel (kernels/skinny_gemm.py, `tma=True`) at one launch config."""
    from metrale.kernels.skinny_gemm import _tma_ready, skinny_gemm_triton

    assert _tma_ready(x, w), "these operands would not take the TMA kernel"
    return skinny_gemm_triton(x, w, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                              tma=True)


def check_small(device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    for M, N, K in ((2, 40, 96), (5, 64, 256), (3, 33, 128)):
        x = torch.randn(M, K, device=device, generator=gen)
        w = torch.randn(N, K, device=device, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            out = skinny_tma(x.to(dtype), w.to(dtype), 16, 32, 4, 2).float()
            ref = F.linear(x.to(dtype).float(), w.to(dtype).float())
            torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    print("skinny_tma matches F.linear at small shapes (M, N, K partial tiles included)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="2,3,5")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args()
    if args.check_only or not torch.cuda.is_available():
        check_small("cuda" if torch.cuda.is_available() else "cpu")
        return 0
    from gemv_bench import copy_bandwidth, time_graph

    from metrale.kernels.gemv import gemv_triton
    from metrale.kernels.skinny_gemm import skinny_config, skinny_gemm_triton

    check_small("cuda")
    dtype = torch.bfloat16
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(0)}: copy {bw / 1e12:.2f} TB/s, bf16, {args.calls} calls per graph\n")
    print("| shape | M | floor us | cuBLAS | GEMV (1 row) | skinny default | best TMA (config) | TMA/floor |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        wbytes = N * K * 2
        copies = min(args.calls, max(1, math.ceil(4 * l2 / wbytes)))
        gen = torch.Generator(device="cuda").manual_seed(0)
        weights = [(torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(dtype) for _ in range(copies)]
        floor = wbytes / bw * 1e6
        x1 = torch.randn(1, K, device="cuda", generator=gen).to(dtype)
        gemv = time_graph(lambda i: gemv_triton(x1, weights[i % copies]), args.calls, args.replays)
        for M in (int(m) for m in args.m.split(",")):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            ref = F.linear(x, weights[0]).float()
            cublas = time_graph(lambda i: F.linear(x, weights[i % copies]), args.calls, args.replays)
            cfg = skinny_config(M, N, K, dtype)
            skinny = time_graph(lambda i: skinny_gemm_triton(x, weights[i % copies]), args.calls, args.replays)
            results = {}
            for c in GRID:
                try:
                    torch.testing.assert_close(skinny_tma(x, weights[0], *c).float(), ref, rtol=2e-2, atol=2e-2)
                    results[c] = time_graph(lambda i, c=c: skinny_tma(x, weights[i % copies], *c),
                                            args.calls, args.replays)
                except Exception as e:  # a config that does not compile or fit: skipped, said so
                    print(f"  {name} M={M} {c}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            best = min(results, key=results.get) if results else None
            best_s = f"{results[best]:.2f} ({'/'.join(map(str, best))})" if best else "-"
            print(f"| {name} {N}x{K} | {M} | {floor:.1f} | {cublas:.2f} | {gemv:.2f} | {skinny:.2f} "
                  f"({'/'.join(map(str, cfg))}) | {best_s} | {floor / results[best]:.0%} |"
                  if best else f"| {name} | {M} | {floor:.1f} | {cublas:.2f} | {gemv:.2f} | {skinny:.2f} | - | - |",
                  flush=True)
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
