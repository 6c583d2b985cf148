"""SiLU-and-mul: the gated activation of SwiGLU MLPs, on [.., 2 * d] -> [.., d]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.kernels import use_triton


def clamp_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[.., 2 * d] (gate then up) -> a copy with the gate clamped to at most `limit` and the up
    to [-limit, limit]: the "swiglu_limit" of GLM-5.3 (and GPT-OSS-style) MLPs, applied before
    silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat((gate.clamp(max=limit), up.clamp(-limit, limit)), dim=-1)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from metrale.kernels.activation import silu_and_mul_triton

            return silu_and_mul_triton(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
