"""The gated MLP of Llama-style blocks (SwiGLU): down(silu(gate(x)) * up(x)), gate and up fused in
one column-parallel matmul, down row-parallel. With `swiglu_limit` (GLM-5.3) gate and up are
clamped first (layers/activation.py's clamp_swiglu); each rank's slice holds its gate rows then
its up rows, so the clamp needs no communication."""

from __future__ import annotations

import torch
from torch import nn

from metrale.layers.activation import SiluAndMul, clamp_swiglu
from metrale.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 swiglu_limit: float | None = None):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.swiglu_limit is not None:
            gate_up = clamp_swiglu(gate_up, self.swiglu_limit)
        return self.down_proj(self.act_fn(gate_up))
