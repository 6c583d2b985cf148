"""The feed-forward parts of vision blocks, replicated on every tensor-parallel rank: Qwen2.5-VL's
gated MLP (gate and up in one matmul, as the checkpoint's gate_proj / up_proj load into
gate_up_proj), Qwen3-VL's two-layer MLP and Qwen2-VL's (the same, named fc1 / fc2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.layers.linear import ReplicatedLinear, _copy_checked


def activation(name: str):
    table = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
             "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}
    if name not in table:
        raise ValueError(f"vision activation {name!r} is not supported (supported: {', '.join(table)})")
    return table[name]


class ReplicatedMergedLinear(ReplicatedLinear):
    """Several projections of one input stacked (gate, up), whole on every rank."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool):
        super().__init__(input_size, sum(output_sizes), bias, quantizable=False)
        self.output_sizes = output_sizes

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            _copy_checked(param, loaded, type(self).__name__)
            return
        offset = sum(self.output_sizes[:shard_id])
        _copy_checked(param.data.narrow(0, offset, self.output_sizes[shard_id]), loaded,
                      f"{type(self).__name__}[{shard_id}]")


class VisionGatedMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, act: str):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = ReplicatedMergedLinear(dim, [intermediate] * 2, bias=True)
        self.down_proj = ReplicatedLinear(intermediate, dim, bias=True, quantizable=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, act: str):
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(dim, intermediate, bias=True, quantizable=False)
        self.linear_fc2 = ReplicatedLinear(intermediate, dim, bias=True, quantizable=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen2VisionMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, act: str):
        super().__init__()
        self.fc1 = ReplicatedLinear(dim, intermediate, bias=True, quantizable=False)
        self.fc2 = ReplicatedLinear(intermediate, dim, bias=True, quantizable=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
