"""Qwen3's per-head q/k RMSNorm fused with the rotary embedding: one launch, IN PLACE on q and k.
The same launch can store the rotated K and V into the paged KV cache (any model with RoPE on
the Triton path: `rope_store_kv_triton`), so a layer's attention prologue is one kernel.

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

from metrale.kernels import pdl_args, pdl_wait, reference, tl, triton, use_triton
from metrale.kernels.rotary import NO_FMA, rotary_pair_offsets, rotate_pair


@triton.jit
def _to_cache(x, inv_scale, FP8: tl.constexpr, cache_dtype: tl.constexpr):
    # A value in the model dtype as the KV cache stores it (kv_cache_write.py's numerics): an
    # fp8 cache holds x / scale, saturated at e4m3's largest finite value.
    if FP8:
        return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(cache_dtype)
    return x.to(cache_dtype)


@triton.jit
def _norm_rope_heads(x_ptr, w_ptr, rows, h_ok, kv_ptr, kv_rows, inv_scale, store, cos, sin, i, eps,
                     NORM: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, HALF: tl.constexpr,
                     IS_NEOX: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    # A block of heads of one token: rows [BLOCK_H] are their offsets from x_ptr (h_ok masks the
    # block's tail), d their dims [BLOCK_D], i the rotary pair index [BLOCK_HALF]. All loads come
    # before all stores (one warp, so in step): each whole head as one row (its mean square is
    # summed exactly as the rms_norm kernel sums a row, so rstd matches the two-step path), and
    # the rotary pairs (x1, x2) re-read from it. Each pair is stored from the lanes that loaded
    # it; the tail (dims >= ROT_DIM) is disjoint from every pair. Where `store`, the result also
    # goes to the KV cache at kv_ptr + kv_rows.
    dtype = x_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)[None, :]
    i = i[None, :]
    in_head = h_ok[:, None] & (d < HEAD_DIM)
    i1, i2 = rotary_pair_offsets(i, IS_NEOX, HALF)
    pair = h_ok[:, None] & (i < HALF)
    base = x_ptr + rows[:, None]
    x = tl.load(base + d, mask=in_head, other=0.0).to(tl.float32)
    x1 = tl.load(base + i1, mask=pair, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=pair, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + i1, mask=i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + i2, mask=i < HALF, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        # RMSNorm's output in the model dtype: normalise, round, multiply by the weight, round.
        y = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype)
        y1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    else:  # rotary alone (rotary.py's numerics)
        y, y1, y2 = x.to(dtype), x1, x2
    # rotary.py's math on the rounded norm output: fp32, one rounding per element
    r1, r2 = rotate_pair(y1, y2, cos[None, :], sin[None, :])
    r1, r2 = r1.to(dtype), r2.to(dtype)
    tail = in_head & (d >= ROT_DIM)  # partial rotary: the tail is only normed
    if NORM:
        tl.store(base + d, y, mask=tail)
    tl.store(base + i1, r1, mask=pair)
    tl.store(base + i2, r2, mask=pair)
    if store:
        kv_dtype = kv_ptr.dtype.element_ty
        kv_base = kv_ptr + kv_rows[:, None]
        tl.store(kv_base + d, _to_cache(y, inv_scale, FP8, kv_dtype), mask=tail)
        tl.store(kv_base + i1, _to_cache(r1, inv_scale, FP8, kv_dtype), mask=pair)
        tl.store(kv_base + i2, _to_cache(r2, inv_scale, FP8, kv_dtype), mask=pair)


@triton.jit
def _qk_norm_rope_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos_sin,
    stride_cb, stride_co, stride_ch,
    num_q_heads, num_kv_heads, eps, block_size, inv_k_scale, inv_v_scale,
    NORM: tl.constexpr, STORE_KV: tl.constexpr, FP8: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # Grid (tokens, head blocks): BLOCK_H heads per program, q's blocks first, then k's [then v's
    # with STORE_KV: copied into the cache, nothing else]; no block mixes q, k and v heads.
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    kv_blocks = tl.cdiv(num_kv_heads, BLOCK_H)
    h = tl.arange(0, BLOCK_H)
    kvh = ((blk - q_blocks) % tl.maximum(kv_blocks, 1)) * BLOCK_H + h  # the block's k or v heads; unused for q
    kv_rows = tl.zeros([BLOCK_H], tl.int64)
    store = False
    if STORE_KV:
        slot = tl.load(slot_ptr + t)  # -1: a padding token, nothing is stored
        store = slot >= 0
        kv_rows = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + kvh * stride_ch
    if blk >= q_blocks + kv_blocks:
        if store:
            d = tl.arange(0, BLOCK_D)[None, :]
            mask = (kvh < num_kv_heads)[:, None] & (d < HEAD_DIM)
            v = tl.load(v_ptr + t * stride_vt + kvh[:, None] * stride_vh + d, mask=mask)
            tl.store(v_cache_ptr + kv_rows[:, None] + d,
                     _to_cache(v, inv_v_scale, FP8, v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        pos = tl.load(pos_ptr + t)
        i = tl.arange(0, BLOCK_HALF)
        cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + i, mask=i < HALF, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        if blk < q_blocks:
            qh = blk * BLOCK_H + h
            _norm_rope_heads(q_ptr, qw_ptr, t * stride_qt + qh * stride_qh, qh < num_q_heads, k_cache_ptr,
                             kv_rows, 1.0, False, cos, sin, i, eps, NORM, HEAD_DIM, ROT_DIM, HALF, IS_NEOX,
                             BLOCK_D, FP8)
        else:
            _norm_rope_heads(k_ptr, kw_ptr, t * stride_kt + kvh.to(tl.int64) * stride_kh, kvh < num_kv_heads,
                             k_cache_ptr, kv_rows, inv_k_scale, store, cos, sin, i, eps, NORM, HEAD_DIM,
                             ROT_DIM, HALF, IS_NEOX, BLOCK_D, FP8)


# Heads per program: a prefill step's (tokens x heads) programs of one head each were bound by
# the SMs' rate of starting programs (Qwen3-0.6B, 8192 tokens: 160 us per layer on an H200).
PROLOGUE_BLOCK_H = 8


def qk_norm_rope_triton(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, rotary_dim, is_neox):
    """Triton path of qk_norm_rope; modifies q and k in place (one launch) and returns them."""
    assert q_weight is not None and k_weight is not None
    return rope_store_kv_triton(positions, q, k, None, cos_sin_cache, rotary_dim, is_neox,
                                qk_norm=(q_weight, k_weight, eps))


def rope_store_kv_triton(positions, q, k, v, cos_sin_cache, rotary_dim, is_neox, qk_norm=None, kv_cache=None,
                         slot_mapping=None, k_scale: float = 1.0, v_scale: float = 1.0):
    """One launch: per-head RMSNorm of q and k if `qk_norm` = (q_weight, k_weight, eps), rotary
    on both, IN PLACE; and with `kv_cache` = (k_cache, v_cache), the rotated k and v stored at
    each token's slot (as write_kv_cache would: slot -1 stores nothing, an fp8 cache gets
    value / scale). Returns (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.dim() == 3 and k.shape[0] == num_tokens == positions.shape[0] and k.shape[2] == head_dim
    assert q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim and cos_sin_cache.shape[-1] == rotary_dim
    assert cos_sin_cache.stride(-1) == 1
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # weights unused without a norm
    if qk_norm is not None:
        assert q_weight.shape == k_weight.shape == (head_dim,) and q_weight.is_contiguous() and k_weight.is_contiguous()
    store = kv_cache is not None
    if store:
        k_cache, v_cache = kv_cache
        assert v is not None and v.shape == k.shape and v.stride(-1) == 1 and slot_mapping.shape == (num_tokens,)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
        assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    else:
        k_cache = v_cache = slot_mapping = v = k  # unused
    block_h = min(PROLOGUE_BLOCK_H, triton.next_power_of_2(max(num_q_heads, num_kv_heads, 1)))
    num_blocks = triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h) * (2 if store else 1)
    if num_tokens > 0 and num_q_heads > 0:
        half = rotary_dim // 2
        _qk_norm_rope_kernel[(num_tokens, num_blocks)](
            positions, q, k, v, q_weight, k_weight, cos_sin_cache, slot_mapping, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2) if store else 0,
            num_q_heads, num_kv_heads, eps, k_cache.shape[1], 1.0 / k_scale, 1.0 / v_scale,
            NORM=qk_norm is not None, STORE_KV=store, FP8=store and k_cache.dtype == torch.float8_e4m3fn,
            HEAD_DIM=head_dim, ROT_DIM=rotary_dim, IS_NEOX=is_neox,
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_H=block_h,
            # one warp: lanes that hold the same element (tiny rotary dims) run the pair loads
            # before the stores in step
            num_warps=1, **NO_FMA, **pdl_args(),
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
