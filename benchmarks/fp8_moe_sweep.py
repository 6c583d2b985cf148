"""Tiles of the FP8 grouped MoE GEMM (kernels/fp8_moe_gemm.py) against the bf16 grouped GEMM, on
the GPU, at Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048, intermediate 768, [128, 128]
blocks) for prefill- and batch-sized token counts. One config serves both GEMMs of a call.

    PYTHONPATH=. python3 benchmarks/fp8_moe_sweep.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_moe_bench import quantized_experts  # noqa: E402
from gemv_bench import time_graph  # noqa: E402

from metrale.kernels.fp8_moe_gemm import Fp8MoeGemmConfig, fp8_moe_gemm_config, fused_experts_fp8_triton  # noqa: E402
from metrale.layers.moe import select_experts  # noqa: E402
from metrale.layers.moe.triton_moe import fused_experts_triton  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
CONFIGS = [(16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (32, 128, 128, 4, 3), (64, 64, 128, 4, 3), (64, 128, 128, 4, 3),
           (64, 128, 128, 4, 4), (64, 128, 128, 8, 3), (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 64, 128, 4, 3)]


def main():
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    (q13, s13), (q2, s2) = quantized_experts(w13), quantized_experts(w2)
    print("| tokens | kernel | config | us |")
    print("|---:|---|---|---:|")
    for tokens in (64, 256, 512, 2048, 4096):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, ids = select_experts(torch.randn(tokens, EXPERTS, device="cuda"), TOP_K, "softmax", True)
        us = time_graph(lambda i: fused_experts_triton(x, w13, w2, weights, ids), 5, 10)
        print(f"| {tokens} | bf16 grouped | default | {us:.1f} |")
        default = fp8_moe_gemm_config(tokens * TOP_K, 2 * INTER, HIDDEN, EXPERTS, 128)
        best = None
        for cfg in [default] + [Fp8MoeGemmConfig(*c) for c in CONFIGS]:
            try:
                us = time_graph(lambda i: fused_experts_fp8_triton(x, q13, q2, s13, s2, 128, 128, 128, weights, ids, 0,
                                                                   128, config=cfg), 5, 10)
            except Exception as e:  # shared memory or registers
                print(f"| {tokens} | fp8 W8A8 | {tuple(cfg)} | failed: {type(e).__name__} |")
                continue
            best = min(best or (us, cfg), (us, cfg))
            print(f"| {tokens} | fp8 W8A8 | {tuple(cfg)}{' (default)' if cfg == default else ''} | {us:.1f} |")
        print(f"best {tokens}: {tuple(best[1])} {best[0]:.1f} us")


if __name__ == "__main__":
    main()
