"""The FP8 state of a linear or expert layer: how its scales are laid out and which kernel runs it.

A layer converted by `layers.quantization.apply` holds
    weight / w13 / w2                 float8_e4m3fn, the shapes of the unquantized weight
    weight_scale_inv / w13_... / w2_...  float32 scales (layers/quantization/scales.py)
and an `fp8` attribute, one of the classes below, that its forward hands the matmul to.
`group_n` is 1 while loading (a scale row per weight row) and the checkpoint's block_n after
`finish_loading` wherever the layout allows; `block_k` (the scale columns' width) never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metrale.kernels.fp8_math import FP8_DTYPE, cdiv
from metrale.layers.quantization.scales import compress_rows


def fp8_parameter(*shape: int, device, like: nn.Parameter | None = None) -> nn.Parameter:
    """An FP8 weight that keeps the weight_loader of the parameter it replaces."""
    param = nn.Parameter(torch.empty(*shape, dtype=FP8_DTYPE, device=device), requires_grad=False)
    if like is not None and hasattr(like, "weight_loader"):
        param.weight_loader = like.weight_loader
    return param


def scale_parameter(*shape: int, block_k: int, device, loader) -> nn.Parameter:
    """Per-row scales [..., rows, ceil(K / block_k)], loaded by the weight's own loader."""
    *lead, rows, cols = shape
    param = nn.Parameter(torch.ones(*lead, rows, cdiv(cols, block_k), dtype=torch.float32, device=device),
                         requires_grad=False)
    param.weight_loader = loader
    param.column_unit = block_k  # what an expert loader divides column offsets by
    return param


@dataclass
class Fp8Linear:
    block_n: int  # the checkpoint's scale block (rows), what loaded scales are expanded from
    block_k: int
    activation_group: int | None
    group_n: int = 1

    def matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from metrale.kernels.fp8_linear import fp8_linear

        return fp8_linear(x, layer.weight, layer.weight_scale_inv, self.group_n, self.block_k, bias,
                          self.activation_group)

    def finish_loading(self, layer: nn.Module) -> None:
        scale, self.group_n = compress_rows(layer.weight_scale_inv.data, self.block_n)
        layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)


@dataclass
class Fp8Experts:
    block_n: int
    block_k: int
    activation_group: int | None
    group_n13: int = 1
    group_n2: int = 1

    def experts(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        from metrale.layers.moe.fp8_experts import fused_experts_fp8

        return fused_experts_fp8(hidden, layer.w13, layer.w2, layer.w13_weight_scale_inv, layer.w2_weight_scale_inv,
                                 self.group_n13, self.group_n2, self.block_k, topk_weights, topk_ids,
                                 layer.expert_start, self.activation_group)

    def finish_loading(self, layer: nn.Module) -> None:
        w13, self.group_n13 = compress_rows(layer.w13_weight_scale_inv.data, self.block_n)
        w2, self.group_n2 = compress_rows(layer.w2_weight_scale_inv.data, self.block_n)
        layer.w13_weight_scale_inv = nn.Parameter(w13, requires_grad=False)
        layer.w2_weight_scale_inv = nn.Parameter(w2, requires_grad=False)
