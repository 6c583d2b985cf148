"""A pre-norm ViT block: x + attn(norm1(x)), then + mlp(norm2(x)). The norm kind (RMSNorm for
Qwen2.5-VL, LayerNorm for Qwen3-VL) and the MLP are the family's."""

from __future__ import annotations

import torch
from torch import nn

from metrale.layers.vision.attention import VisionAttention


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, make_norm):
        super().__init__()
        self.norm1, self.norm2 = make_norm(dim), make_norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))
