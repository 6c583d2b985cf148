"""Patch mergers: each spatial_merge_size x spatial_merge_size block of patches (consecutive in
the merge-block order) becomes one token of the text model's width."""

from __future__ import annotations

import torch
from torch import nn

from metrale.layers.linear import ReplicatedLinear
from metrale.layers.norm import RMSNorm


class Qwen2_5PatchMerger(nn.Module):
    """A norm per patch (ln_q: RMSNorm for Qwen2.5-VL, LayerNorm for Qwen2-VL), concatenate the
    block, Linear, GELU, Linear (mlp.0, mlp.2)."""

    def __init__(self, dim: int, out_dim: int, merge_size: int, layer_norm: bool = False):
        super().__init__()
        self.merged = dim * merge_size * merge_size
        self.ln_q = nn.LayerNorm(dim, eps=1e-6) if layer_norm else RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(ReplicatedLinear(self.merged, self.merged, bias=True, quantizable=False), nn.GELU(),
                                 ReplicatedLinear(self.merged, out_dim, bias=True, quantizable=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm per patch, or over the concatenated block (`postshuffle_norm`, the DeepStack
    mergers), then linear_fc1, GELU, linear_fc2."""

    def __init__(self, dim: int, out_dim: int, merge_size: int, postshuffle_norm: bool):
        super().__init__()
        self.merged = dim * merge_size * merge_size
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else dim, eps=1e-6)
        self.linear_fc1 = ReplicatedLinear(self.merged, self.merged, bias=True, quantizable=False)
        self.act = nn.GELU()
        self.linear_fc2 = ReplicatedLinear(self.merged, out_dim, bias=True, quantizable=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle_norm else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(self.act(self.linear_fc1(x)))
