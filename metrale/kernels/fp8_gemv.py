"""FP8-weight GEMV for tiny M: y = x @ W^T (+ bias), x [M, K] with 1 <= M <= 4, W8A16.

The FP8 counterpart of `gemv.py` (same design, same determinism) for batch-1..4 decode, where
a linear layer is bound by reading its weight once from HBM: an fp8 weight halves those bytes,
and x is not quantized (W8A16), so no quantization kernel runs before it. Contract:
  * weight float8_e4m3fn [N, K] with contiguous rows, weight_scale float32 [ceil(N / group_n),
    ceil(K / group_k)] (`kernels/fp8_math.py`); group_n any positive size, group_k a
    multiple of 16 or >= K. x [M, K] bf16/fp16/fp32 (rows may be strided, last dim
    contiguous), bias [N] or None. y [M, N] is a new tensor of x's dtype.
  * Products and sums are in fp32: each thread multiplies one 16-byte weight vector (16 fp8
    elements, which lie in one K group because group_k is a multiple of 16 or >= K) by x,
    sums the 16 products, and multiplies that partial sum by the vector's scale. y is rounded
    once at the end (after the bias add). Against `fp8_linear_reference` (W dequantized to
    fp32, then an fp32 matmul) only the fp32 rounding order differs.
  * Deterministic: no split-K and no atomics; each output element is summed by one program in
    an order fixed by K and the launch config, a pure function of (M, N, K)
    (`fp8_gemv_config`), so results are bitwise identical from run to run.

Design (as gemv.py): program i owns output rows [i*BLOCK_N, (i+1)*BLOCK_N) for all M rows of
x and streams those weight rows over K in BLOCK_K chunks, loaded as [BLOCK_N, BLOCK_K // 16,
16]: the last axis is one 16-byte load per thread and is reduced in registers, the
accumulators are [BLOCK_N, BLOCK_K // 16] per x row, and the only cross-thread reduction
happens once, after the K loop. The scales are gathered per vector ([BLOCK_N, BLOCK_K // 16]
float32, a few distinct addresses per warp, served from L1). Rows past N re-read row N-1
(loads stay unmasked) and are dropped at the store; only a partial last K chunk is masked.
num_stages 1 = plain loads; >= 2 = the K loop software-pipelined through a cp.async ring.
With PDL the first weight chunk and its scales are loaded before pdl_wait (no kernel writes
weights); x, which the previous kernel produced, only after it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from metrale.kernels import pdl_args, pdl_wait, tl, triton
from metrale.kernels import fp8_math

MAX_M = 4
VEC = 16  # fp8 elements per 16-byte load
_NUM_SMS = 132  # an H100/H200 SXM: a constant keeps the config a function of the shapes alone
_PROGRAMS_PER_SM = 4


class Fp8GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def fp8_gemv_config(M: int, N: int, K: int) -> Fp8GemvConfig:
    """Default launch config.

      M == 1: chunks of 4 KiB per weight row (a whole K = 4096 row: one 16-byte vector per
              thread of 8 warps) and four rows per program. On an H200 (benchmarks/
              fp8_gemm_bench.py, at 09dbbd8) this took 11.1, 8.1, 35.9 and
              16.5 us for Qwen3-8B's qkv, o_proj, gate_up and down (2.3-3.1 TB/s), against 12.6,
              9.1, 42.6 and 18.5 with two rows per program; the conversion of each fp8 element
              to float32 bounds it there, not the bandwidth. (Widening the weights with
              integer ops instead, a byte permute, a shift and a mask per element and one
              multiply, was 10-19% slower on an H100 at `8625fee`: 13.45 against 11.81 us
              for qkv, 42.88 against 36.04 for gate_up; reverted.)
      M >= 2: chunks of 2 KiB, 4 warps when N > 8192; else 1 KiB, 2 warps (M == 2) or 512 B,
              1 warp (M >= 3); cp.async ring of 3 stages; BLOCK_N 4. With activations quantized,
              fp8_linear takes the W8A8 GEMM from two rows on, which is faster there.
    BLOCK_N then halves (down to 1) while N / BLOCK_N < 4 programs per SM; the chunk is capped
    at K rounded up to a power of two (at least 16), and num_warps at what keeps every warp
    along K (BLOCK_K >= 16 * 32 * num_warps).
    """
    k_cap = max(triton.next_power_of_2(K), VEC)
    if M == 1:
        block_n, chunk, num_warps, num_stages = 4, 4096, 8, 1
    elif N > 8192:
        block_n, chunk, num_warps, num_stages = 4, 2048, 4, 3
    elif M == 2:
        block_n, chunk, num_warps, num_stages = 4, 1024, 2, 3
    else:
        block_n, chunk, num_warps, num_stages = 4, 512, 1, 3
    block_k = min(chunk, k_cap)
    while block_n > 1 and triton.cdiv(N, block_n) < _PROGRAMS_PER_SM * _NUM_SMS:
        block_n //= 2
    num_warps = max(1, min(num_warps, block_k // (VEC * 32)))
    return Fp8GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


@triton.jit
def _load_chunk(w_ptrs, s_ptrs, k_vec, group_k, kmask, vmask, MASKED: tl.constexpr):
    # One chunk of weight rows (float32 [BLOCK_N, BLOCK_K // VEC, VEC]) and the scale of each
    # of its vectors ([BLOCK_N, BLOCK_K // VEC]); k_vec holds the vectors' first k.
    if MASKED:
        w = tl.load(w_ptrs, mask=kmask[None, :, :], other=0.0)
        s = tl.load(s_ptrs + (k_vec // group_k)[None, :], mask=vmask[None, :], other=0.0)
    else:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs + (k_vec // group_k)[None, :])
    return w.to(tl.float32), s


@triton.jit
def _fp8_gemv_acc(acc, w, s, x_ptrs, kmask, MASKED: tl.constexpr):
    # acc [BLOCK_N, BLOCK_K // VEC] += scale * (sum over the thread-local VEC axis of w * x).
    if MASKED:
        x = tl.load(x_ptrs, mask=kmask, other=0.0)
    else:
        x = tl.load(x_ptrs)
    return acc + tl.sum(w * x.to(tl.float32)[None, :, :], axis=2) * s


@triton.jit
def _fp8_gemv_rows(acc0, acc1, acc2, acc3, w, s, x_ptrs, stride_xm, kmask, M: tl.constexpr, MASKED: tl.constexpr):
    # A loaded weight chunk against every row of x.
    acc0 = _fp8_gemv_acc(acc0, w, s, x_ptrs, kmask, MASKED)
    if M > 1:
        acc1 = _fp8_gemv_acc(acc1, w, s, x_ptrs + stride_xm, kmask, MASKED)
    if M > 2:
        acc2 = _fp8_gemv_acc(acc2, w, s, x_ptrs + 2 * stride_xm, kmask, MASKED)
    if M > 3:
        acc3 = _fp8_gemv_acc(acc3, w, s, x_ptrs + 3 * stride_xm, kmask, MASKED)
    return acc0, acc1, acc2, acc3


@triton.jit
def _fp8_gemv_store(acc, b, y_ptrs, nmask, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += b
    tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=nmask)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    N, K, group_n, group_k, stride_xm, stride_wn, stride_sn, stride_ym,
    M: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),). Program owns output columns n0..n0+BLOCK_N of every row of y.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N-1: loads stay unmasked
    # k offsets of one chunk as [BLOCK_K // VEC, VEC]: the last axis is one 16-byte vector per thread
    k_vec = tl.arange(0, BLOCK_K // VEC) * VEC
    kk = k_vec[:, None] + tl.arange(0, VEC)[None, :]
    w_ptrs = w_ptr + rows[:, None, None] * stride_wn + kk[None, :, :]
    s_ptrs = s_ptr + (rows // group_n)[:, None] * stride_sn
    x_ptrs = x_ptr + kk

    acc0 = tl.full([BLOCK_N, BLOCK_K // VEC], 0.0, tl.float32)
    acc1 = tl.full([BLOCK_N, BLOCK_K // VEC], 0.0, tl.float32)
    acc2 = tl.full([BLOCK_N, BLOCK_K // VEC], 0.0, tl.float32)
    acc3 = tl.full([BLOCK_N, BLOCK_K // VEC], 0.0, tl.float32)
    k_full = (K // BLOCK_K) * BLOCK_K
    k_start = 0
    if PREFETCH:  # PDL and at least one full chunk: weights and scales before the wait
        w_first, s_first = _load_chunk(w_ptrs, s_ptrs, k_vec, group_k, None, None, False)
    pdl_wait(PDL)
    if PREFETCH:
        acc0, acc1, acc2, acc3 = _fp8_gemv_rows(acc0, acc1, acc2, acc3, w_first, s_first, x_ptrs, stride_xm,
                                                None, M, False)
        k_start = BLOCK_K
    for k0 in tl.range(k_start, k_full, BLOCK_K, num_stages=NUM_STAGES):
        w, s = _load_chunk(w_ptrs + k0, s_ptrs, k0 + k_vec, group_k, None, None, False)
        acc0, acc1, acc2, acc3 = _fp8_gemv_rows(acc0, acc1, acc2, acc3, w, s, x_ptrs + k0, stride_xm,
                                                None, M, False)
    if not EVEN_K:  # the partial last chunk
        kmask = (k_full + kk) < K
        w, s = _load_chunk(w_ptrs + k_full, s_ptrs, k_full + k_vec, group_k, kmask, (k_full + k_vec) < K, True)
        acc0, acc1, acc2, acc3 = _fp8_gemv_rows(acc0, acc1, acc2, acc3, w, s, x_ptrs + k_full, stride_xm,
                                                kmask, M, True)

    b = 0.0
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + offs_n
    _fp8_gemv_store(acc0, b, y_ptrs, nmask, HAS_BIAS)
    if M > 1:
        _fp8_gemv_store(acc1, b, y_ptrs + stride_ym, nmask, HAS_BIAS)
    if M > 2:
        _fp8_gemv_store(acc2, b, y_ptrs + 2 * stride_ym, nmask, HAS_BIAS)
    if M > 3:
        _fp8_gemv_store(acc3, b, y_ptrs + 3 * stride_ym, nmask, HAS_BIAS)


def fp8_gemv_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_n: int, group_k: int,
                    bias: torch.Tensor | None = None, *, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 4) @ W[N, K].T (+ bias[N]) -> [M, N] in x's dtype, always via Triton.
    `config` replaces `fp8_gemv_config(M, N, K)` (for benchmarks); block_n and block_k must be
    powers of two, block_k at least 16."""
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K], weight [N, K]"
    M, K = x.shape
    N = weight.shape[0]
    assert M <= MAX_M, f"the fp8 gemv handles at most {MAX_M} rows, got {M}"
    assert weight.shape[1] == K and weight.dtype == fp8_math.FP8_DTYPE, (tuple(weight.shape), weight.dtype)
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert weight.stride(1) == 1 and weight.stride(0) >= K, "weight rows must be contiguous"
    assert weight_scale.dtype == torch.float32 and weight_scale.stride(1) == 1, weight_scale.dtype
    assert weight_scale.shape == (triton.cdiv(N, group_n), triton.cdiv(K, min(group_k, max(K, 1)))), \
        (tuple(weight_scale.shape), group_n, group_k)
    assert group_k >= K or group_k % VEC == 0, f"group_k {group_k}: a multiple of {VEC}, or >= K"
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        assert bias.shape == (N,), bias.shape
        bias = bias.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))

    cfg = config or fp8_gemv_config(M, N, K)
    assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.block_k & (cfg.block_k - 1) == 0, cfg
    assert cfg.block_k >= VEC and cfg.num_stages >= 1, cfg
    pdl = pdl_args()
    _fp8_gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, weight_scale, bias if bias is not None else y, y,
        N, K, group_n, group_k, x.stride(0), weight.stride(0), weight_scale.stride(0), y.stride(0),
        M=M, HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=VEC, NUM_STAGES=cfg.num_stages,
        PREFETCH=pdl["PDL"] and K >= cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    return y
