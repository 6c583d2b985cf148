"""The attention backend interface: writes the new tokens' K and V into the paged cache and
computes attention of the flattened query rows over it (layout in layers/forward_context.py).
The PyTorch backend is the reference and runs anywhere; the Triton backend is tested against it.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from metrale.layers.cache_backend import CacheBackend
from metrale.layers.forward_context import AttentionMetadata, BatchLayout


class AttentionBackend(CacheBackend):
    kind = "attention"
    # The layer may store K and V itself, in its RoPE kernel (Attention's fused prologue), with
    # the Triton KV write's layout and numerics, instead of calling write_kv.
    fused_prologue: bool = False

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        return AttentionMetadata.of(layout)

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim].
        An fp8 cache stores k / k_scale and v / v_scale, saturated at +-448."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; an fp8 cache
        is read back as value x scale."""
