"""The skinny tensor-core GEMM (metrale/kernels/skinny_gemm.py) against cuBLAS (F.linear) and the
CUDA-core GEMV (kernels/gemv.py, M <= 4) on Qwen3-8B's projections, for the row counts of verify
steps at small batch (M = batch x (1 + k)). Each figure: the median over replays of a CUDA graph
of back-to-back calls that cycle through enough weight copies to overflow L2 (every call streams
its weight from HBM, as a decoder layer does), per call; bandwidth as a share of a measured
device-to-device copy. Prints a markdown table and, per shape and M, the fastest kernel and
skinny config; writes no files.

    PYTHONPATH=. python3 benchmarks/skinny_gemm_bench.py [--m 2,3,5,8,16] [--default-only]
        [--configs 16/512/4/1,32/256/4/2] [--each]

`--configs` replaces the grid (block_n/block_k/num_warps/num_stages each); `--each` also prints
every config's time, not only the best.
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
from gemv_bench import copy_bandwidth, time_graph  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "gate_up": (24576, 4096), "o_proj": (4096, 4096), "down": (4096, 12288)}
# (block_n, block_k, num_warps, num_stages), tried after the default
GRID = [(16, 512, 4, 3), (16, 128, 4, 6), (32, 256, 4, 4), (16, 256, 2, 4), (64, 256, 4, 3),
        (16, 512, 8, 3), (32, 128, 4, 5), (16, 256, 4, 6), (32, 512, 8, 3)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,2,3,4,5,8,16")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--default-only", action="store_true")
    parser.add_argument("--configs", default=None, help="block_n/block_k/num_warps/num_stages,... instead of the grid")
    parser.add_argument("--each", action="store_true", help="print every config's time")
    args = parser.parse_args()
    try:
        grid = GRID if args.configs is None else [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",")]
    except ValueError:
        parser.error(f"--configs: expected block_n/block_k/num_warps/num_stages,..., got {args.configs!r}")
    if any(len(c) != 4 for c in grid):
        parser.error("--configs: each entry is block_n/block_k/num_warps/num_stages")
    if not torch.cuda.is_available():
        print("skinny_gemm_bench.py needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 1
    from metrale.kernels.gemv import gemv_triton
    from metrale.kernels.skinny_gemm import SkinnyConfig, skinny_config, skinny_gemm_triton

    dtype = torch.bfloat16
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(0)}: copy {bw / 1e12:.2f} TB/s, bf16, {args.calls} calls per graph\n")
    print("| shape | M | floor us | cuBLAS | GEMV | skinny default | best skinny (config) | best/floor |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        wbytes = N * K * 2
        copies = min(args.calls, max(1, math.ceil(4 * l2 / wbytes)))
        gen = torch.Generator(device="cuda").manual_seed(0)
        weights = [(torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(dtype) for _ in range(copies)]
        floor = wbytes / bw * 1e6  # the weight read once at the copy bandwidth (read + write bytes / s)
        for M in (int(m) for m in args.m.split(",")):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            ref = F.linear(x, weights[0]).float()
            cublas = time_graph(lambda i: F.linear(x, weights[i % copies]), args.calls, args.replays)
            gemv = (time_graph(lambda i: gemv_triton(x, weights[i % copies]), args.calls, args.replays)
                    if M <= 4 else float("nan"))
            default = skinny_config(M, N, K, dtype)
            results = {}
            if M >= 2:
                configs = [default] + ([] if args.default_only else [SkinnyConfig(*c) for c in grid])
                for c in dict.fromkeys(configs):
                    kw = c._asdict()
                    try:
                        out = skinny_gemm_triton(x, weights[0], **kw).float()
                        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
                        results[c] = time_graph(lambda i, kw=kw: skinny_gemm_triton(x, weights[i % copies], **kw),
                                                args.calls, args.replays)
                    except Exception as e:  # a config that does not compile or fit: skipped, said so
                        print(f"  {name} M={M} {tuple(c)}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
            if args.each:
                for c, t in sorted(results.items(), key=lambda item: item[1]):
                    print(f"    {name} M={M} {'/'.join(map(str, c))}: {t:.2f} us ({floor / t:.0%} of the floor)",
                          flush=True)
            best = min(results, key=results.get) if results else None
            best_s = f"{results[best]:.2f} ({'/'.join(map(str, best))})" if best else "-"
            default_s = f"{results[default]:.2f}" if default in results else "-"
            overall = min([cublas, gemv if M <= 4 else float("inf")] + ([results[best]] if best else []))
            print(f"| {name} {N}x{K} | {M} | {floor:.1f} | {cublas:.2f} | {gemv:.2f} | {default_s} | {best_s} | "
                  f"{floor / overall:.0%} |", flush=True)
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
