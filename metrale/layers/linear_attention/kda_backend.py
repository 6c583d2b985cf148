"""The Kimi Delta Attention backend interface (cache kind "kda"): the causal conv1d over each
sequence with its saved inputs, and the delta rule with a per-channel decay over its recurrent
state, both over per-request state slots (layouts in metrale/kernels/reference_kda.py). It reads
the same per-step metadata as Gated DeltaNet (sequence starts, state slots, fresh or continuing,
pure decode). Only the PyTorch backend exists, which is the reference.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from metrale.layers.cache_backend import CacheBackend
from metrale.layers.forward_context import BatchLayout
from metrale.layers.linear_attention.backend import GDNMetadata

KIND = "kda"


class KDABackend(CacheBackend):
    kind = KIND

    def build_metadata(self, layout: BatchLayout) -> GDNMetadata:
        return GDNMetadata.of(layout)

    @abstractmethod
    def conv(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
             metadata: GDNMetadata) -> torch.Tensor:
        """silu(causal depthwise conv) of x [num_tokens, channels], each sequence preceded by its
        saved inputs; weight [channels, kernel]; updates conv_state [slots, channels, kernel - 1]."""

    @abstractmethod
    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   recurrent_state: torch.Tensor, metadata: GDNMetadata) -> torch.Tensor:
        """KDA with the per-channel log decay g [T, heads, head_dim] (float32) and write strength
        beta [T, heads]; q, k, v [T, heads, head_dim] -> [T, heads, head_dim]; updates
        recurrent_state [slots, heads, head_dim, head_dim]."""
