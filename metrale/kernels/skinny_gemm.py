"""Skinny GEMM on tensor cores: y = x @ weight.T (+ bias) for x [M, K] with 2 <= M <= 16.

Made for the verify steps of speculative decoding at small batch (M = batch x (1 + k) rows),
where a linear layer is still bound by reading its weight once from HBM, and where the CUDA-core
GEMV (kernels/gemv.py, best at M = 1) pays for every extra row in FMAs and cuBLAS reads the
weight at 60-80% of the bandwidth on Qwen3-8B's projections. Contract:
  * x [M, K] (last dim contiguous), weight [N, K] with contiguous rows, bias [N] or None; one
    dtype for all, bf16/fp16/fp32. y [M, N] is a new tensor of x's dtype.
  * Products and sums in fp32 (fp32 inputs use IEEE fp32 dots, never TF32), y rounded once after
    the bias add.
  * Deterministic: no split-K, no atomics; the launch config is a pure function of (M, N, K,
    dtype) (`skinny_config`), so results are bitwise identical from run to run.

Design ("swap AB"): program i owns output columns [i*BLOCK_N, (i+1)*BLOCK_N) (weight rows) for all
M rows. It streams its weight rows over K in BLOCK_K chunks through a cp.async ring of
NUM_STAGES buffers and accumulates tl.dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, 16]) in fp32: x's
rows past M are loaded as zeros, so the tensor cores do the M rows' work at no extra weight
traffic. Weight rows past N re-read row N-1 (loads stay unmasked) and are dropped at the store.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from metrale.kernels import interpret_mode, pdl_args, pdl_wait, tl, triton, use_triton
from metrale.kernels.gemv import linear_operands

MIN_M, MAX_M = 2, 16
_BLOCK_M = 16  # x's rows, padded: the smallest tl.dot operand
# Whether the kernel takes programmatic dependent launch where the engine enables it (a benchmark
# switch: spec_verify_bench.py --skinny-pdl). Off: in one H200 job at `5a226ea`, Qwen3-8B's batch-1
# verify steps (k = 1 / 2 / 4) took 1.112 / 1.117 / 1.164x a plain step with the kernel launched
# without PDL, 1.195 / 1.239 / 1.211x with PDL, 1.186 / 1.230 / 1.195x with PDL and an early
# trigger of the next kernel, and 1.133 / 1.140 / 1.189x on cuBLAS. (Loading the first weight chunk
# before the PDL wait gained nothing either, `9cda78b`.)
PDL_LAUNCH = False

class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def skinny_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> SkinnyConfig:
    """Default launch config, from an H200 run of benchmarks/skinny_gemm_bench.py (`f788f90`, bf16,
    M = 2..16, us per call against cuBLAS; docs/benchmarks.md): 256-element chunks everywhere;
    16 weight rows per program with 2 warps and a 4-deep cp.async ring for N = 6144 (qkv: 15.2 vs
    15.6), 32 rows with 4 warps otherwise (o_proj 4096 x 4096: 11.8 vs 13.1; down 4096 x 12288:
    27.8 vs 30.2; gate_up 24576 x 4096: 50.0, cuBLAS's 49.8). Where N <= 4096 the grid has about
    one program per SM, and each keeps a 6-deep ring in flight instead of 4 (an H100 sweep at
    `55c450b`: o_proj 13.66 against 13.94 us, down 35.75 against 37.09, at M = 5)."""
    block_k = min(256 if dtype.itemsize <= 2 else 128, max(16, triton.next_power_of_2(K)))
    if 4096 < N <= 8192:
        return SkinnyConfig(block_n=16, block_k=block_k, num_warps=2, num_stages=4)
    return SkinnyConfig(block_n=32, block_k=block_k, num_warps=4, num_stages=6 if N <= 4096 else 4)


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    xt_ptrs = x_ptr + offs_k[:, None] + offs_m[None, :] * stride_xm  # x^T [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    pdl_wait(PDL)  # x comes from the previous kernel
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            xt = tl.load(xt_ptrs + k0, mask=mmask[None, :], other=0.0)
        else:
            kmask = (k0 + offs_k) < K
            w = tl.load(w_ptrs + k0, mask=kmask[None, :], other=0.0)
            xt = tl.load(xt_ptrs + k0, mask=kmask[:, None] & mmask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(w, xt, input_precision="ieee")
        elif INTERPRET:  # the CPU interpreter's 16-bit tl.dot gives garbage (Triton 3.x): widen first
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(w, xt)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & mmask[None, :])


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       block_n: int | None = None, block_k: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight[N, K].T (+ bias[N]) -> [M, N] in x's dtype, always via Triton.
    The keyword overrides replace fields of `skinny_config` (for benchmarks)."""
    x, bias, y, done = linear_operands(x, weight, bias, MAX_M, "skinny_gemm")
    if done:
        return y
    (M, K), N = x.shape, weight.shape[0]
    cfg = skinny_config(M, N, K, x.dtype)
    cfg = SkinnyConfig(block_n or cfg.block_n, block_k or cfg.block_k, num_warps or cfg.num_warps,
                       num_stages or cfg.num_stages)
    _skinny_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, bias if bias is not None else y, y,
        M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0, IEEE=x.dtype == torch.float32,
        INTERPRET=interpret_mode(),
        BLOCK_M=_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **(pdl_args() if PDL_LAUNCH else {"PDL": False}),
    )
    return y


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K]: the skinny kernel for CUDA tensors with 2..16
    rows (and a contiguous-row weight), torch.nn.functional.linear otherwise."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if (use_triton(x) and MIN_M <= rows <= MAX_M and weight.stride(-1) == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return skinny_gemm_triton(x.reshape(rows, K), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
