"""The Qwen2.5-VL vision tower, as transformers' Qwen2_5_VisionTransformerPretrainedModel:

    patches -> PatchEmbed -> permute into window order (merged units grouped by window)
            -> blocks (RMSNorm, SwiGLU MLP): full attention per frame in `fullatt_block_indexes`,
               attention within each window elsewhere; 2D rotary of each patch's (row, column)
            -> Qwen2.5 patch merger -> undo the window permutation -> [merged tokens, out_hidden_size]

Replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.layers.norm import RMSNorm
from metrale.layers.vision.block import VisionBlock
from metrale.layers.vision.grid import frame_cu_seqlens, patch_positions, window_partition
from metrale.layers.vision.merger import Qwen2_5PatchMerger
from metrale.layers.vision.mlp import VisionGatedMLP
from metrale.layers.vision.patch_embed import PatchEmbed
from metrale.layers.vision.rotary import VisionRotary2D


def _theta(vision_config) -> float:
    params = getattr(vision_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", 10000.0))


class Qwen2_5VisionTower(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.merge_size = vc.spatial_merge_size
        self.fullatt_block_indexes = set(vc.fullatt_block_indexes)
        self.window_units = vc.window_size // vc.spatial_merge_size // vc.patch_size
        if self.window_units < 1:
            raise ValueError(f"window_size {vc.window_size} is smaller than one merged patch")
        self.patch_embed = PatchEmbed(vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.hidden_size, bias=False)
        self.rotary = VisionRotary2D(vc.hidden_size // vc.num_heads, _theta(vc))
        self.blocks = nn.ModuleList(
            VisionBlock(vc.hidden_size, vc.num_heads, VisionGatedMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act),
                        lambda d: RMSNorm(d, 1e-6))
            for _ in range(vc.depth))
        self.merger = Qwen2_5PatchMerger(vc.hidden_size, vc.out_hidden_size, vc.spatial_merge_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[patches, C*T*P*P], grid_thw [items, 3] -> [patches / merge**2, out_hidden_size], items in order."""
        grid_thw = grid_thw.cpu()
        unit = self.merge_size ** 2
        window_index, cu_windows = window_partition(grid_thw, self.merge_size, self.window_units)
        cu_frames = frame_cu_seqlens(grid_thw).tolist()
        cu_windows = cu_windows.tolist()
        # The patch order inside a merged unit is kept; the units move to window order.
        patch_order = (window_index[:, None] * unit + torch.arange(unit)).flatten().to(pixel_values.device)
        x = self.patch_embed(pixel_values)[patch_order]
        cos, sin = self.rotary(patch_positions(grid_thw, self.merge_size))
        cos, sin = cos.to(x.device)[patch_order], sin.to(x.device)[patch_order]
        for i, block in enumerate(self.blocks):
            x = block(x, cu_frames if i in self.fullatt_block_indexes else cu_windows, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(window_index).to(merged.device)]
