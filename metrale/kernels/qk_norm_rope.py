"""Qwen3's per-head q/k RMSNorm fused with the rotary embedding: one launch, IN PLACE on q and k.

For every token t and every head of q (weight q_weight) and of k (weight k_weight):
    y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)    # rms_norm.py's numerics
    y = rotary(y, positions[t])                                            # rotary.py's numerics
The normalised value is rounded to the model dtype before the weight multiply, and the product
is rounded to the model dtype (as RMSNorm's output is) BEFORE it is rotated; the mean square is
summed like the rms_norm kernel sums a row. So the result is the two-step path's (norm kernel,
then rotary kernel); bit-identical under the interpreter. Rotary math is fp32 with one rounding
per output element; dims >= rotary_dim get the normalised value only.
"""

from __future__ import annotations

import torch

from metrale.kernels import reference, tl, triton, use_triton
from metrale.kernels.rotary import rotary_pair_offsets


@triton.jit
def _norm_rope_head(x_ptr, w_ptr, row, cos, sin, i, eps,
                    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, HALF: tl.constexpr,
                    IS_NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
    # One head at x_ptr + row; d: its dims [BLOCK_D], i: rotary pair index [BLOCK_HALF].
    # All loads come before all stores: the whole head as one vector (its mean square is
    # summed exactly as the rms_norm kernel sums a row, so rstd matches the two-step path),
    # and the rotary pairs (x1, x2) re-read from it. Each pair is stored from the lanes that
    # loaded it; the tail (dims >= ROT_DIM) is disjoint from every pair.
    dtype = x_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    in_head = d < HEAD_DIM
    i1, i2 = rotary_pair_offsets(i, IS_NEOX, HALF)
    pair = i < HALF
    x = tl.load(x_ptr + row + d, mask=in_head, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + row + i1, mask=pair, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row + i2, mask=pair, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=in_head, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + i1, mask=pair, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + i2, mask=pair, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    # RMSNorm's output in the model dtype: normalise, round, multiply by the weight, round.
    y = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype)
    y1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(x_ptr + row + d, y, mask=in_head & (d >= ROT_DIM))  # partial rotary: the tail is only normed
    # rotary.py's math on the rounded norm output: fp32, one rounding per element
    tl.store(x_ptr + row + i1, (y1 * cos - y2 * sin).to(dtype), mask=pair)
    tl.store(x_ptr + row + i2, (y2 * cos + y1 * sin).to(dtype), mask=pair)


@triton.jit
def _qk_norm_rope_kernel(
    pos_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, eps,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (tokens, q heads + k heads): heads [0, num_q_heads) are q's, the rest k's.
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    if head < num_q_heads:
        _norm_rope_head(q_ptr, qw_ptr, t * stride_qt + head * stride_qh, cos, sin, i, eps,
                        HEAD_DIM, ROT_DIM, HALF, IS_NEOX, BLOCK_D)
    else:
        kh = (head - num_q_heads).to(tl.int64)
        _norm_rope_head(k_ptr, kw_ptr, t * stride_kt + kh * stride_kh, cos, sin, i, eps,
                        HEAD_DIM, ROT_DIM, HALF, IS_NEOX, BLOCK_D)


def qk_norm_rope_triton(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, rotary_dim, is_neox):
    """Triton path of qk_norm_rope; modifies q and k in place (one launch) and returns them."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens == positions.shape[0] and k.shape[2] == head_dim
    assert q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    assert q_weight.shape == k_weight.shape == (head_dim,) and q_weight.is_contiguous() and k_weight.is_contiguous()
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim and cos_sin_cache.shape[-1] == rotary_dim
    assert cos_sin_cache.stride(-1) == 1
    num_heads = num_q_heads + k.shape[1]
    if num_tokens > 0 and num_heads > 0:
        half = rotary_dim // 2
        _qk_norm_rope_kernel[(num_tokens, num_heads)](
            positions, q, k, q_weight, k_weight, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            num_q_heads, eps,
            HEAD_DIM=head_dim, ROT_DIM=rotary_dim, IS_NEOX=is_neox,
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim),
            # one head per program, one warp (as the rms_norm kernel up to 256 dims): lanes that hold
            # the same element (tiny rotary dims) run the pair loads before the stores in step
            num_warps=1,
        )
    return q, k


def qk_norm_rope(positions, q, k, q_weight, k_weight, eps: float, cos_sin_cache, rotary_dim: int, is_neox: bool):
    """positions int64 [T]; q [T, Hq, D]; k [T, Hkv, D] (strided views are fine); weights [D].
    Per-head RMSNorm of q and k, then rotary, IN PLACE; returns (q, k)."""
    if use_triton(q):
        return qk_norm_rope_triton(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, rotary_dim, is_neox)
    q_new, k_new = reference.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, rotary_dim,
                                          is_neox)
    q.copy_(q_new)
    k.copy_(k_new)
    return q, k
