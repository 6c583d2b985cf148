"""The Attention layer models use: heads in, heads out; the backend and cache do the rest."""

from __future__ import annotations

import torch
from torch import nn

from metrale.executor.forward_context import get_forward_context
from metrale.kernels import use_triton


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
        """q, k after RoPE: K and V are written to the cache, then q attends over it."""
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
        return self._attend(q, ctx)

    def can_fuse_prologue(self, q: torch.Tensor) -> bool:
        """Whether `rope_and_attend` may do RoPE and the K/V write in one kernel: on CUDA with a
        backend that reads the cache as the Triton KV write leaves it, and not while fp8
        scales are being calibrated (which must see K and V)."""
        return (use_triton(q) and get_forward_context().attn_backend.fused_prologue and self.kv_cache is not None
                and self.observed_amax is None)

    def rope_and_attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        rotary_emb, qk_norms=None) -> torch.Tensor:
        """q, k BEFORE RoPE: per-head RMSNorm of q and k when `qk_norms` = (q_norm, k_norm),
        RoPE and the K/V write in one launch (rope_store_kv_triton), then attention. Only where
        can_fuse_prologue(q)."""
        from metrale.kernels.qk_norm_rope import rope_store_kv_triton

        ctx = get_forward_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norm = None
        if qk_norms is not None:
            q_norm, k_norm = qk_norms
            norm = (q_norm.weight, k_norm.weight, q_norm.eps)
        rope_store_kv_triton(positions, q, k, v, rotary_emb.cos_sin_cache, rotary_emb.rotary_dim,
                             rotary_emb.is_neox_style, qk_norm=norm, kv_cache=self.kv_cache,
                             slot_mapping=ctx.attn_metadata.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        return self._attend(q, ctx)

    def _attend(self, q: torch.Tensor, ctx) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache
        out = ctx.attn_backend.forward(q, k_cache, v_cache, ctx.attn_metadata, self.scale, self.k_scale, self.v_scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
