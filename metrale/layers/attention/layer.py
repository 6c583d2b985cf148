"""The Attention layer models use: heads in, heads out; the backend and cache do the rest."""

from __future__ import annotations

import torch
from torch import nn

from metrale.executor.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        # Bound by the model runner once the pool exists: (k_cache, v_cache), each
        # [num_blocks, block_size, num_kv_heads, head_dim].
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per-layer scales of an fp8 cache (stored value = x / scale): from the checkpoint's
        # k_scale / v_scale, from calibration, or 1.0. Plain floats: CUDA graphs bake them in.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # While calibrating, the largest |K| and |V| this layer has produced.
        self.observed_amax: list[float] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not bound to this attention layer")
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = self.kv_cache
        if self.observed_amax is not None:
            self.observed_amax[0] = max(self.observed_amax[0], k.abs().max().item())
            self.observed_amax[1] = max(self.observed_amax[1], v.abs().max().item())
        ctx.attn_backend.write_kv(k, v, k_cache, v_cache, ctx.attn_metadata.slot_mapping, self.k_scale, self.v_scale)
        out = ctx.attn_backend.forward(q, k_cache, v_cache, ctx.attn_metadata, self.scale, self.k_scale, self.v_scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
