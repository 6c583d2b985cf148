"""Rotary position embedding, applied IN PLACE to q and k.

For token t at position p = positions[t], with half = rotary_dim // 2 and
cos_sin_cache[p] = [cos_0..cos_{half-1}, sin_0..sin_{half-1}] (fp32), each pair
(x1, x2) of every head becomes (x1*cos_i - x2*sin_i, x2*cos_i + x1*sin_i):
  neox style (HF Llama/Qwen): x1 = x[i],  x2 = x[i + half]
  GPT-J style (interleaved):  x1 = x[2i], x2 = x[2i + 1]
Dims >= rotary_dim are left untouched (partial rotary). Math in fp32, one
rounding to the model dtype per output element.
"""

from __future__ import annotations

import torch

from metrale.kernels import reference, tl, triton, use_triton


@triton.jit
def rotary_pair_offsets(i, IS_NEOX: tl.constexpr, HALF: tl.constexpr):
    """Offsets within a head of the pairs (x1, x2) that rotary pair index i turns together."""
    if IS_NEOX:
        return i, i + HALF
    return 2 * i, 2 * i + 1


# Launch option of every kernel that rotates: no multiply-add contraction. The compiler fuses
# `x1 * cos - x2 * sin` into an FMA one way or the other depending on the surrounding code, so
# two kernels (or two variants of one) could round a rotation differently; seen on an H200 as
# 1-ulp differences in ~10 of 1.2M elements between the attention prologue and the rotary
# kernel. Without contraction each product is rounded, as in torch's reference.
NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """The rotation of pairs (x1, x2) in fp32, shared by every kernel that applies RoPE (each
    launched with NO_FMA, so all round it alike)."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, num_heads, t, cos, sin, i,
                  IS_NEOX: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # Rotates all heads of token t; i: pair index [1, BLOCK_HALF] (masked by HALF).
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < num_heads) & (i < HALF)
    i1, i2 = rotary_pair_offsets(i, IS_NEOX, HALF)
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + i1, mask=mask).to(tl.float32)
    x2 = tl.load(base + i2, mask=mask).to(tl.float32)
    r1, r2 = rotate_pair(x1, x2, cos, sin)
    tl.store(base + i1, r1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + i2, r2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads,
    IS_NEOX: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    # One program per token: loads its cos/sin row once, rotates all q and k heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, num_q_heads, t, cos, sin, i, IS_NEOX, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, stride_kt, stride_kh, num_k_heads, t, cos, sin, i, IS_NEOX, HALF, BLOCK_HK)


def apply_rotary_triton(positions, q, k, cos_sin_cache, rotary_dim, is_neox):
    """Triton path of apply_rotary; modifies q and k in place and returns them."""
    num_tokens = positions.shape[0]
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == num_tokens
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    assert rotary_dim % 2 == 0 and rotary_dim <= q.shape[-1] and cos_sin_cache.shape[-1] == rotary_dim
    assert cos_sin_cache.stride(-1) == 1
    if num_tokens > 0:
        half = rotary_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            q.shape[1], k.shape[1],
            IS_NEOX=is_neox, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HK=triton.next_power_of_2(k.shape[1]), **NO_FMA,
        )
    return q, k


def apply_rotary(positions, q, k, cos_sin_cache, rotary_dim: int, is_neox: bool):
    """positions int64 [T]; q [T, Hq, D]; k [T, Hkv, D] (strided views are fine).
    Rotates q and k IN PLACE and returns (q, k)."""
    if use_triton(q):
        return apply_rotary_triton(positions, q, k, cos_sin_cache, rotary_dim, is_neox)
    q_new, k_new = reference.apply_rotary(positions, q, k, cos_sin_cache, rotary_dim, is_neox)
    q.copy_(q_new)
    k.copy_(k_new)
    return q, k
