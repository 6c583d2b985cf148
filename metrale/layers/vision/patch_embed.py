"""Patch embedding: transformers' Conv3d with stride = kernel is, on the processor's flattened
patches [patches, C * T * P * P], one matmul with the kernel flattened the same way (C, T, P, P);
the weight keeps the Conv3d shape so the checkpoint loads as it is."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, dim: int, bias: bool):
        super().__init__()
        self.proj = nn.Module()
        shape = (dim, in_channels, temporal_patch_size, patch_size, patch_size)
        self.proj.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        self.proj.bias = nn.Parameter(torch.empty(dim), requires_grad=False) if bias else None
        self.patch_width = in_channels * temporal_patch_size * patch_size * patch_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.patch_width:
            raise ValueError(f"pixel_values {list(pixel_values.shape)} are not [patches, {self.patch_width}]")
        return F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)
