"""GEMV for tiny M: y = x @ weight.T (+ bias), x [M, K] with 1 <= M <= 4, weight [N, K].

Made for batch-1..4 decode, where a linear layer is bound by reading its weight
once from HBM. Contract:
  * x [M, K] (rows may be strided, last dim contiguous), weight [N, K] with
    contiguous rows (nn.Linear.weight), bias [N] or None; one dtype for all of
    them, bf16/fp16/fp32. y [M, N] is a new tensor of x's dtype.
  * Products and sums are in fp32 and y is rounded once at the end (after the
    bias add), like cuBLAS with an fp32 compute type.
  * Deterministic: no split-K and no atomics. Each output element is summed by
    one program in an order fixed by K and the launch config, and the config is
    a pure function of (M, N, K, dtype) (`gemv_config`, no timing-based
    autotuning), so results are bitwise identical from run to run.

Design: program i owns output rows [i*BLOCK_N, (i+1)*BLOCK_N) for all M rows of
x and streams those weight rows over K in BLOCK_K chunks. A chunk is loaded as
[BLOCK_N, BLOCK_K // VEC, VEC] with VEC = 16 bytes of elements, so every thread
issues 16-byte loads along a contiguous weight row and reduces its own VEC
products in registers (the VEC axis is thread-local): the accumulators are
[BLOCK_N, BLOCK_K // VEC] per x row and the only cross-thread reduction happens
once, after the K loop. Rows past N re-read row N-1 (loads stay unmasked) and
are dropped at the store; only a partial last K chunk is masked.

num_stages selects how chunks are fetched: 1 = plain 16-byte loads into registers
(latency hidden by the many programs resident per SM); >= 2 = the K loop is
software-pipelined by Triton (tl.range(num_stages=...)): chunks are prefetched
with cp.async into a ring of num_stages shared-memory buffers (BLOCK_N * BLOCK_K
elements each). Warps are laid out along K only when BLOCK_K >= VEC * 32 *
num_warps; below that x's tile needs a shared-memory layout conversion every
chunk (still correct, slower), so configs should respect it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# interpret_mode: for callers
from metrale.kernels import interpret_mode, pdl_args, pdl_wait, tl, triton, use_triton  # noqa: F401

MAX_M = 4
# Programs the default config aims to give each SM. 132 is an H100/H200 SXM; the constant (rather
# than the device's count) keeps the config a function of the shapes alone.
_NUM_SMS = 132
_PROGRAMS_PER_SM = 4


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _vec(dtype: torch.dtype, block_k: int) -> int:
    """Elements per 16-byte load, capped by the chunk width."""
    return max(1, min(16 // dtype.itemsize, block_k))


def gemv_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """Default launch config, set from H200 runs of benchmarks/gemv_bench.py (bf16; each tried
    13-25 configs per shape, so these are the best seen, not a full search):

      M == 1: one weight row per program, read 8 KiB at a time with 8 warps and plain loads, so
              a program issues its whole row (K = 4096) at once. Measured at `97d7852` (us, vs
              cuBLAS; copy bandwidth 4.20 TB/s): qkv 6144x4096 13.4 vs 15.7, gate_up 24576x4096
              46.1 vs 49.7, o_proj 4096x4096 9.7 vs 13.2, down 4096x12288 24.6 vs 30.4; two rows
              per program came within 1 us of it everywhere. The earlier rule (4 rows, 2 KiB
              chunks, 4 warps) took 15.7, 56.6, 10.4 and 25.2.
      M >= 2: BLOCK_N 4 (smaller only when N / 4 < 4 programs per SM);
              N <= 8192, M == 2: 1 KiB per chunk, 2 warps, cp.async ring of 3 stages
              N <= 8192, M >= 3: 512 B per chunk, 1 warp, cp.async ring of 3 stages
              N >  8192:         2 KiB per chunk, 4 warps, cp.async ring of 3 stages
    The chunk is capped at K rounded up to a power of two, and num_warps at what keeps every
    warp along K.
    """
    elem = dtype.itemsize
    k_cap = max(triton.next_power_of_2(K), 16)
    if M == 1:
        block_k = min(8192 // elem, k_cap)
        num_warps = max(1, min(8, block_k // (_vec(dtype, block_k) * 32)))
        return GemvConfig(block_n=1, block_k=block_k, num_warps=num_warps, num_stages=1)
    if N > 8192:
        chunk_bytes, num_warps, num_stages = 2048, 4, 3
    elif M == 2:
        chunk_bytes, num_warps, num_stages = 1024, 2, 3
    else:
        chunk_bytes, num_warps, num_stages = 512, 1, 3
    block_k = min(chunk_bytes // elem, k_cap)
    block_n = 4
    while block_n > 1 and triton.cdiv(N, block_n) < _PROGRAMS_PER_SM * _NUM_SMS:
        block_n //= 2
    num_warps = max(1, min(num_warps, block_k // (_vec(dtype, block_k) * 32)))
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


@triton.jit
def _gemv_acc(acc, w, x_ptrs, kmask, MASKED: tl.constexpr):
    # acc [BLOCK_N, BLOCK_K // VEC] += sum over the thread-local VEC axis of w * x.
    if MASKED:
        x = tl.load(x_ptrs, mask=kmask, other=0.0)
    else:
        x = tl.load(x_ptrs)
    return acc + tl.sum(w * x.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv_chunk(acc0, acc1, acc2, acc3, w_ptrs, x_ptrs, stride_xm, kmask,
                M: tl.constexpr, MASKED: tl.constexpr):
    # One BLOCK_K chunk: one read of the weight tile, reused by every row of x.
    if MASKED:
        w = tl.load(w_ptrs, mask=kmask[None, :, :], other=0.0).to(tl.float32)
    else:
        w = tl.load(w_ptrs).to(tl.float32)
    return _gemv_rows(acc0, acc1, acc2, acc3, w, x_ptrs, stride_xm, kmask, M, MASKED)


@triton.jit
def _gemv_rows(acc0, acc1, acc2, acc3, w, x_ptrs, stride_xm, kmask, M: tl.constexpr, MASKED: tl.constexpr):
    # A loaded weight tile against every row of x.
    acc0 = _gemv_acc(acc0, w, x_ptrs, kmask, MASKED)
    if M > 1:
        acc1 = _gemv_acc(acc1, w, x_ptrs + stride_xm, kmask, MASKED)
    if M > 2:
        acc2 = _gemv_acc(acc2, w, x_ptrs + 2 * stride_xm, kmask, MASKED)
    if M > 3:
        acc3 = _gemv_acc(acc3, w, x_ptrs + 3 * stride_xm, kmask, MASKED)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_store(acc, b, y_ptrs, nmask, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += b
    tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=nmask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, K, stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),). Program owns output columns n0..n0+BLOCK_N of every row of y.
    # With PDL the first weight chunk is loaded BEFORE waiting for the previous kernel (no
    # kernel writes weights), so the program streams from HBM while that kernel drains; x,
    # which the previous kernel produced, is read only after the wait.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N-1: loads stay unmasked
    # k offsets of one chunk as [BLOCK_K // VEC, VEC]: the last axis is one 16-byte vector per thread
    kk = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    w_ptrs = w_ptr + rows[:, None, None] * stride_wn + kk[None, :, :]
    x_ptrs = x_ptr + kk

    acc0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    k_full = (K // BLOCK_K) * BLOCK_K
    k_start = 0
    if PREFETCH:  # PDL and at least one full chunk
        w_first = tl.load(w_ptrs).to(tl.float32)
    pdl_wait(PDL)
    if PREFETCH:
        acc0, acc1, acc2, acc3 = _gemv_rows(acc0, acc1, acc2, acc3, w_first, x_ptrs, stride_xm, None, M, False)
        k_start = BLOCK_K
    for k0 in tl.range(k_start, k_full, BLOCK_K, num_stages=NUM_STAGES):
        acc0, acc1, acc2, acc3 = _gemv_chunk(acc0, acc1, acc2, acc3, w_ptrs + k0, x_ptrs + k0,
                                             stride_xm, None, M, False)
    if not EVEN_K:  # the partial last chunk
        kmask = (k_full + kk) < K
        acc0, acc1, acc2, acc3 = _gemv_chunk(acc0, acc1, acc2, acc3, w_ptrs + k_full, x_ptrs + k_full,
                                             stride_xm, kmask, M, True)

    b = 0.0
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + offs_n
    _gemv_store(acc0, b, y_ptrs, nmask, HAS_BIAS)
    if M > 1:
        _gemv_store(acc1, b, y_ptrs + stride_ym, nmask, HAS_BIAS)
    if M > 2:
        _gemv_store(acc2, b, y_ptrs + 2 * stride_ym, nmask, HAS_BIAS)
    if M > 3:
        _gemv_store(acc3, b, y_ptrs + 3 * stride_ym, nmask, HAS_BIAS)


def linear_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
                    name: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool]:
    """The checks and the output of a small-M linear kernel (this GEMV, kernels/skinny_gemm.py):
    (x with contiguous rows, contiguous bias, y [M, N] allocated, done) where done means y is
    already the answer (an empty shape, or K == 0: the bias alone)."""
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K], weight [N, K]"
    M, K = x.shape
    N = weight.shape[0]
    assert M <= max_rows, f"{name} handles at most {max_rows} rows, got {M}"
    assert weight.shape[1] == K, f"x has K={K}, weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32), \
        (x.dtype, weight.dtype)
    assert weight.stride(1) == 1 and weight.stride(0) >= K, "weight rows must be contiguous"
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        assert bias.shape == (N,) and bias.dtype == x.dtype, (bias.shape, bias.dtype)
        bias = bias.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return x, bias, y, True
    if K == 0:
        return x, bias, (y.zero_() if bias is None else y.copy_(bias.expand(M, N))), True
    return x, bias, y, False


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 4) @ weight[N, K].T (+ bias[N]) -> [M, N] in x's dtype, always via Triton.

    The keyword overrides replace fields of `gemv_config(M, N, K, dtype)` (for benchmarks);
    block_n and block_k must be powers of two.
    """
    x, bias, y, done = linear_operands(x, weight, bias, MAX_M, "gemv")
    if done:
        return y
    (M, K), N = x.shape, weight.shape[0]

    cfg = gemv_config(M, N, K, x.dtype)
    cfg = GemvConfig(block_n=block_n or cfg.block_n, block_k=block_k or cfg.block_k,
                     num_warps=num_warps or cfg.num_warps,
                     num_stages=cfg.num_stages if num_stages is None else num_stages)
    assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.block_k & (cfg.block_k - 1) == 0, cfg
    assert cfg.num_stages >= 1, cfg
    vec = _vec(x.dtype, cfg.block_k)
    pdl = pdl_args()
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, bias if bias is not None else y, y,
        N, K, x.stride(0), weight.stride(0), y.stride(0),
        M=M, HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=vec, NUM_STAGES=cfg.num_stages,
        PREFETCH=pdl["PDL"] and K >= cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K]: the Triton GEMV for CUDA tensors with at most
    4 rows (and a contiguous-row weight), torch.nn.functional.linear otherwise."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if (use_triton(x) and 0 < rows <= MAX_M and weight.stride(-1) == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return gemv_triton(x.reshape(rows, K), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
