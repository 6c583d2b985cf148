"""SiLU-and-mul: the gated activation of SwiGLU MLPs, on [.., 2 * d] -> [.., d]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.kernels import use_triton


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from metrale.kernels.activation import silu_and_mul_triton

            return silu_and_mul_triton(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
