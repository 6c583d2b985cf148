"""Scatter the step's new latents into the paged MLA cache.

cache [num_blocks, block_size, latent + rope], contiguous. Token t's entry [kv_c[t] | k_pe[t]]
goes to slot s = slot_mapping[t] (block s // block_size, offset s % block_size); s == -1 is
padding, not written. An fp8 cache stores value / latent_scale saturated at e4m3's +-448, as
the MHA KV write does. No host read: it runs inside the decode CUDA graphs.

Under the Triton interpreter the float32 -> e4m3 conversion drops the mantissa's carry (7.94
becomes 4.0, not 8.0; triton 3.9), so there the wrapper quantizes with torch and the kernel
scatters the bytes; the in-kernel quantization runs on GPUs (tests/gpu/test_gpu_mla_backend.py).
"""

from __future__ import annotations

import torch

from metrale.kernels import interpret_mode, tl, triton

FP8 = torch.float8_e4m3fn


@triton.jit
def _write_latent_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, stride_ct, stride_pt, stride_cb, stride_co,
    block_size, inv_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_co  # int64: slot is
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    c = tl.load(kv_c_ptr + t.to(tl.int64) * stride_ct + dl, mask=dl < LATENT)
    pe = tl.load(k_pe_ptr + t.to(tl.int64) * stride_pt + dr, mask=dr < ROPE)
    if FP8:
        c = tl.clamp(c.to(tl.float32) * inv_scale, -448.0, 448.0)
        pe = tl.clamp(pe.to(tl.float32) * inv_scale, -448.0, 448.0)
    tl.store(dst + dl, c.to(cache_ptr.dtype.element_ty), mask=dl < LATENT)
    tl.store(dst + LATENT + dr, pe.to(cache_ptr.dtype.element_ty), mask=dr < ROPE)


def write_latent_triton(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                        latent_scale: float = 1.0) -> None:
    """kv_c [T, latent], k_pe [T, rope] (last dims contiguous) into cache at slot_mapping [T]."""
    tokens, latent = kv_c.shape
    rope = k_pe.shape[1]
    assert k_pe.shape[0] == tokens == slot_mapping.shape[0] and cache.shape[2] == latent + rope
    assert kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1 and cache.is_contiguous()
    if tokens == 0:
        return
    fp8 = cache.dtype == FP8
    if fp8 and interpret_mode():
        kv_c, k_pe = ((x.float() * (1.0 / latent_scale)).clamp(-448.0, 448.0).to(FP8).view(torch.uint8)
                      for x in (kv_c, k_pe))
        cache, fp8 = cache.view(torch.uint8), False
    _write_latent_kernel[(tokens,)](
        kv_c, k_pe, cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        cache.shape[1], 1.0 / latent_scale,
        LATENT=latent, ROPE=rope, BLOCK_L=triton.next_power_of_2(latent), BLOCK_R=triton.next_power_of_2(rope),
        FP8=fp8,
    )
