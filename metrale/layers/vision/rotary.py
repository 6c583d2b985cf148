"""The 2D rotary of the Qwen-VL vision towers: a quarter of the head's frequencies turn with the
patch's row, the next quarter with its column, and that half is repeated (neox layout)."""

from __future__ import annotations

import torch
from torch import nn


class VisionRotary2D(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        half = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [tokens, 2] (row, column) -> (cos, sin), each [tokens, head_dim] float32."""
        angles = positions.to(self.inv_freq.device)[..., None].float() * self.inv_freq  # [tokens, 2, head_dim/4]
        angles = angles.flatten(1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()
