"""Where batch-1 FP8 decode loses its time, on the GPU: the W8A16 GEMV against the W8A8 GEMM run
skinny (M = 1..16 rows, small N tiles, x quantized first) at Qwen3-8B's projection shapes, and
whether the Triton activation quantizer agrees with torch's bit for bit.

    PYTHONPATH=. python3 benchmarks/fp8_skinny_probe.py
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_bench import time_graph  # noqa: E402

from metrale.kernels import fp8_math  # noqa: E402
from metrale.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_triton  # noqa: E402
from metrale.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv_triton  # noqa: E402
from metrale.kernels.fp8_quant import quantize_activation_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# (block_n, block_k, num_warps, num_stages) tried for the GEMV beside its default
GEMV_CONFIGS = [(2, 2048, 4, 1), (4, 4096, 8, 1), (4, 2048, 4, 1), (8, 2048, 4, 1), (8, 1024, 4, 1), (4, 1024, 2, 1),
                (8, 4096, 8, 1)]
COPIES = 8  # weight copies cycled through, so each call streams its weight from HBM, not L2


def quantizer_agreement():
    torch.manual_seed(0)
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_activation_triton(x, 128)
    rq, rs = fp8_math.quantize_activation(x, 128)
    print(f"quantizer: scales equal {torch.equal(s, rs)}; fp8 bytes differing: "
          f"{int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())} of {q.numel()}")
    diff = (q.view(torch.uint8) != rq.view(torch.uint8)).nonzero()[:8]
    for m, k in diff.tolist():
        v = x[m, k].float() / rs[m, k // 128]
        print(f"  x {x[m, k].item():.6g} scale {rs[m, k // 128].item():.6g} x/scale {v.item():.9g} "
              f"triton {q[m, k].float().item():.6g} ({q.view(torch.uint8)[m, k].item():#04x}) "
              f"torch {rq[m, k].float().item():.6g} ({rq.view(torch.uint8)[m, k].item():#04x})")


def main():
    quantizer_agreement()
    print("| shape | M | kernel | config | us | TB/s |")
    print("|---|---:|---|---|---:|---:|")
    for name, (N, K) in SHAPES.items():
        weights = [fp8_math.quantize_weight(torch.randn(N, K, device="cuda") * 0.02, 128, 128) for _ in range(COPIES)]
        nbytes = N * K
        for M in (1, 4, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            if M <= 4:
                us = time_graph(lambda i: fp8_gemv_triton(x, *weights[i % COPIES], 128, 128), 16, 10)
                print(f"| {name} | {M} | gemv | default | {us:.2f} | {nbytes / us / 1e6:.2f} |")
                for cfg in GEMV_CONFIGS:
                    us = time_graph(lambda i: fp8_gemv_triton(x, *weights[i % COPIES], 128, 128,
                                                              config=Fp8GemvConfig(*cfg)), 16, 10)
                    print(f"| {name} | {M} | gemv | {'/'.join(map(str, cfg))} | {us:.2f} | {nbytes / us / 1e6:.2f} |")
            xq, xs = quantize_activation_triton(x, 128)
            us = time_graph(lambda i: quantize_activation_triton(x, 128), 16, 10)
            print(f"| {name} | {M} | quant | default | {us:.2f} | |")
            best = None
            for bn, (warps, stages) in itertools.product((16, 32), ((2, 4), (4, 6))):
                cfg = Fp8GemmConfig(16, bn, 128, 1, warps, stages)
                try:
                    us = time_graph(lambda i: fp8_gemm_triton(xq, xs, *weights[i % COPIES], 128, 128, 128,
                                                              out_dtype=torch.bfloat16, config=cfg), 16, 10)
                except Exception as e:  # shared memory or register limits
                    print(f"| {name} | {M} | w8a8 | {bn}/{warps}/{stages} | failed: {type(e).__name__} | |")
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
                print(f"| {name} | {M} | w8a8 | {bn}/{warps}/{stages} | {us:.2f} | {nbytes / us / 1e6:.2f} |")
            print(f"best w8a8 {name} M={M}: {best[1]} {best[0]:.2f} us ({nbytes / best[0] / 1e6:.2f} TB/s)")


if __name__ == "__main__":
    main()
