"""Scatter new K/V rows into the paged KV cache.

k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
Token t goes to slot s = slot_mapping[t] (block s // block_size, offset
s % block_size); s == -1 means padding: nothing is written.
"""

from __future__ import annotations

import torch

from metrale.kernels import reference, tl, triton, use_triton


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,  # cache strides (shared by k_cache and v_cache)
    block_size, num_kv_heads, head_dim, inv_k_scale, inv_v_scale,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    # One program per (token, tile of heads); writes all of head_dim.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    off = slot % block_size
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + off * stride_co + h * stride_ch + d  # int64: slot is int64
    if FP8:  # quantise: divide by the layer's scale, saturate at e4m3's largest finite value
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Triton path of write_kv_cache (in place on k_cache / v_cache)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim, 1.0 / k_scale, 1.0 / v_scale,
        BLOCK_H=block_h, BLOCK_D=block_d, FP8=k_cache.dtype == torch.float8_e4m3fn,
    )


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k,v: [num_tokens, num_kv_heads, head_dim] -> k_cache/v_cache[slot] (in place), skipping slot -1."""
    if use_triton(k):
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
