"""The reference attention backend: plain PyTorch over the paged cache, CPU or CUDA.

One sequence at a time: gather its blocks, then causal attention with the query rows placed at
the end of the context. Slow and obviously right; the fast backends are tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.layers.forward_context import AttentionMetadata
from metrale.layers.attention.backend import AttentionBackend
from metrale.layers.cache_backend import register_backend


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype != FP8:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = quantize(v[keep], v_cache.dtype, v_scale)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, kv_heads, head_dim] of one sequence, in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


@register_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        fp8 = k_cache.dtype == FP8
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            if query_len == 0:
                continue
            q_i = q[start:start + query_len].transpose(0, 1)  # [heads, q, d]
            k_i = gather_context(k_cache, metadata.block_tables[i], seq_len).to(q.dtype)
            v_i = gather_context(v_cache, metadata.block_tables[i], seq_len).to(q.dtype)
            if fp8:
                k_i, v_i = k_i * k_scale, v_i * v_scale
            k_i = k_i.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, s, d]
            v_i = v_i.transpose(0, 1).repeat_interleave(group, dim=0)
            # Query row j sits at position seq_len - query_len + j and sees keys 0..that position.
            positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
            o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, scale=scale)
            out[start:start + query_len] = o.transpose(0, 1)
            start += query_len
        return out
