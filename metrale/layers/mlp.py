"""The gated MLP of Llama-style blocks (SwiGLU): down(silu(gate(x)) * up(x)), gate and up fused in
one column-parallel matmul, down row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from metrale.layers.activation import SiluAndMul
from metrale.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
