"""The Qwen3-VL vision tower, as transformers' Qwen3VLVisionModel:

    patches -> PatchEmbed (with bias) + the learned position table resampled to the grid
            -> blocks (LayerNorm, GELU MLP), full attention per frame, 2D rotary
               after block i in `deepstack_visual_indexes`: a DeepStack merger (post-shuffle
               LayerNorm) of that block's output
            -> patch merger -> main [merged tokens, out_hidden_size], DeepStack features alike

Replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.layers.vision.block import VisionBlock
from metrale.layers.vision.grid import frame_cu_seqlens, interpolated_table_index, patch_positions
from metrale.layers.vision.merger import Qwen3PatchMerger
from metrale.layers.vision.mlp import VisionMLP
from metrale.layers.vision.patch_embed import PatchEmbed
from metrale.layers.vision.qwen2_5_tower import _theta
from metrale.layers.vision.rotary import VisionRotary2D


class Qwen3VisionTower(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.merge_size = vc.spatial_merge_size
        self.table_side = int(vc.num_position_embeddings ** 0.5)
        if self.table_side ** 2 != vc.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {vc.num_position_embeddings} is not a square")
        # Qwen3.5's tower is this one without DeepStack (its config has no such field).
        self.deepstack_visual_indexes = list(getattr(vc, "deepstack_visual_indexes", None) or [])
        self.patch_embed = PatchEmbed(vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.rotary = VisionRotary2D(vc.hidden_size // vc.num_heads, _theta(vc))
        self.blocks = nn.ModuleList(
            VisionBlock(vc.hidden_size, vc.num_heads, VisionMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act),
                        lambda d: nn.LayerNorm(d, eps=1e-6))
            for _ in range(vc.depth))
        self.merger = Qwen3PatchMerger(vc.hidden_size, vc.out_hidden_size, vc.spatial_merge_size, False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(vc.hidden_size, vc.out_hidden_size, vc.spatial_merge_size, True)
            for _ in self.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> (main [merged tokens, out_hidden_size], DeepStack features in layer order, each alike)."""
        grid_thw = grid_thw.cpu()
        x = self.patch_embed(pixel_values)
        index, weight = interpolated_table_index(grid_thw, self.table_side, self.merge_size)
        table = self.pos_embed(index.to(x.device)) * weight.to(x.device, self.pos_embed.weight.dtype)[:, :, None]
        x = x + table.sum(1).to(x.dtype)
        cos, sin = self.rotary(patch_positions(grid_thw, self.merge_size))
        cos, sin = cos.to(x.device), sin.to(x.device)
        cu_frames = frame_cu_seqlens(grid_thw).tolist()
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu_frames, cos, sin)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
