"""The Qwen2-VL vision tower, as transformers' Qwen2VisionTransformerPretrainedModel:

    patches -> PatchEmbed -> blocks (LayerNorm, fc1/fc2 MLP of embed_dim * mlp_ratio), full
            attention per frame, 2D rotary -> patch merger (LayerNorm ln_q) -> [merged tokens, hidden_size]

Its config names the tower's width `embed_dim` and the output width `hidden_size`. Replicated on
every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.layers.vision.block import VisionBlock
from metrale.layers.vision.grid import frame_cu_seqlens, patch_positions
from metrale.layers.vision.merger import Qwen2_5PatchMerger
from metrale.layers.vision.mlp import Qwen2VisionMLP
from metrale.layers.vision.patch_embed import PatchEmbed
from metrale.layers.vision.qwen2_5_tower import _theta
from metrale.layers.vision.rotary import VisionRotary2D


class Qwen2VisionTower(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.merge_size = vc.spatial_merge_size
        width = vc.embed_dim
        self.patch_embed = PatchEmbed(vc.in_channels, vc.temporal_patch_size, vc.patch_size, width, bias=False)
        self.rotary = VisionRotary2D(width // vc.num_heads, _theta(vc))
        self.blocks = nn.ModuleList(
            VisionBlock(width, vc.num_heads, Qwen2VisionMLP(width, int(width * vc.mlp_ratio), vc.hidden_act),
                        lambda d: nn.LayerNorm(d, eps=1e-6))
            for _ in range(vc.depth))
        self.merger = Qwen2_5PatchMerger(width, vc.hidden_size, vc.spatial_merge_size, layer_norm=True)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid_thw = grid_thw.cpu()
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(patch_positions(grid_thw, self.merge_size))
        cos, sin = cos.to(x.device), sin.to(x.device)
        cu_frames = frame_cu_seqlens(grid_thw).tolist()
        for block in self.blocks:
            x = block(x, cu_frames, cos, sin)
        return self.merger(x)
