"""FP8 weights and their scales, loaded as pairs.

A fine-grained FP8 checkpoint stores each quantized projection as `X.weight` (float8_e4m3fn
[N, K]) and `X.weight_scale_inv` (float32 or bfloat16 [ceil(N/bn), ceil(K/bk)]). Neither is
usable alone: the scale is expanded to one row per weight row (layers/quantization/scales.py) against
its weight's shape, and both then go through the layer's loader with the same shard. So a
weight waits for its scale and a scale for its weight (in safetensors' sorted order the scale
comes right after its weight, so at most one waits at a time in practice).

High-precision tensors bound for an FP8 layer are quantized here, in the checkpoint's block
format, when that is meant: `--quantization fp8` (online), dummy weights of a quantized config,
and pieces the config lists unquantized that met merges with quantized ones (Qwen3-Next's
in_proj_ba beside in_proj_qkvz). Anything else that does not pair up is an error naming it:
an FP8 weight without its scale, a scale without its weight, an unquantized tensor where the
config says FP8, an FP8 tensor for a layer met keeps unquantized.
"""

from __future__ import annotations

import torch

from metrale.config.errors import ModelLoadError
from metrale.config.quantization import Fp8Config
from metrale.kernels.fp8_math import FP8_DTYPE, quantize_weight
from metrale.layers.quantization.scales import expand_checkpoint_scale

SCALE_SUFFIX = "_scale_inv"  # checkpoint: X.weight -> X.weight_scale_inv


def scale_param_name(param_name: str) -> str:
    """Our scale of a weight parameter: `...qkv_proj.weight_scale_inv`, `...experts.w13_weight_scale_inv`."""
    return param_name + SCALE_SUFFIX if param_name.endswith(".weight") else param_name + "_weight" + SCALE_SUFFIX


class Fp8Pairs:
    def __init__(self, mapping, config: Fp8Config | None, quantize_unquantized: bool):
        self.mapping, self.config = mapping, config
        self.quantize_unquantized = quantize_unquantized or (config is not None and config.online)
        self.weights: dict[str, tuple[str, tuple, torch.Tensor]] = {}  # checkpoint weight -> (param, shard, tensor)
        self.scales: dict[str, torch.Tensor] = {}  # checkpoint weight name -> its scale

    def _is_fp8(self, param_name: str) -> bool:
        return self.mapping.params[param_name].dtype == FP8_DTYPE

    def take_weight(self, checkpoint_name: str, name: str, target: tuple, tensor: torch.Tensor) -> set:
        param_name, shard = target
        if not self._is_fp8(param_name):
            if tensor.dtype == FP8_DTYPE:
                raise ValueError("the checkpoint stores it in FP8, but met keeps this layer unquantized (a router or "
                                 "gate, or listed in quantization_config's modules_to_not_convert)")
            return self.mapping.put(param_name, shard, tensor)
        if tensor.dtype == FP8_DTYPE:
            self.weights[checkpoint_name] = (param_name, shard, tensor)
            return self._pair(checkpoint_name)
        if not (self.quantize_unquantized or self.config.skips(checkpoint_name.removesuffix(".weight"))):
            raise ValueError(f"it is {tensor.dtype}, but the quantization_config makes this layer FP8 and expects a "
                             f"float8 weight with {checkpoint_name}{SCALE_SUFFIX}")
        return self._quantize(param_name, shard, tensor)

    def take_scale(self, checkpoint_name: str, name: str, tensor: torch.Tensor) -> set:
        weight_name = checkpoint_name.removesuffix(SCALE_SUFFIX)
        target = self.mapping.resolve(name.removesuffix(SCALE_SUFFIX))
        if target is None or not self._is_fp8(target[0]) or self.config is None:
            self.mapping.unconsumed.append(checkpoint_name)
            return set()
        self.scales[weight_name] = tensor
        return self._pair(weight_name)

    def _pair(self, weight_name: str) -> set:
        if weight_name not in self.weights or weight_name not in self.scales:
            return set()
        param_name, shard, weight = self.weights.pop(weight_name)
        scale = expand_checkpoint_scale(self.scales.pop(weight_name), tuple(weight.shape), self.config.block_n,
                                        self.config.block_k, weight_name + SCALE_SUFFIX)
        return self._put_pair(param_name, shard, weight, scale)

    def _put_pair(self, param_name: str, shard, weight: torch.Tensor, row_scale: torch.Tensor) -> set:
        return self.mapping.put(param_name, shard, weight) | self.mapping.put(scale_param_name(param_name), shard,
                                                                              row_scale)

    def _quantize(self, param_name: str, shard, tensor: torch.Tensor) -> set:
        """Quantize a high-precision tensor in the checkpoint's format: each [bn, bk] block of
        each projection (a stacked expert tensor per expert and per gate/up half)."""
        if param_name in self.mapping.moe and not isinstance(shard, tuple):
            return self._quantize_stacked_experts(param_name, shard, tensor)
        config = self.config
        weight, scale = quantize_weight(tensor, config.block_n, config.block_k)
        row_scale = expand_checkpoint_scale(scale, tuple(weight.shape), min(config.block_n, weight.shape[0]),
                                            min(config.block_k, weight.shape[1]), param_name)
        return self._put_pair(param_name, shard, weight, row_scale)

    def _quantize_stacked_experts(self, param_name: str, shard: str, tensor: torch.Tensor) -> set:
        layer, _ = self.mapping.moe[param_name]
        supplied = set()
        for expert in range(*layer.expert_range):
            if shard == "w2":
                supplied |= self._quantize(param_name, ("w2", expert), tensor[expert])
            else:
                gate, up = tensor[expert].chunk(2, dim=0)
                supplied |= self._quantize(param_name, ("w1", expert), gate)
                supplied |= self._quantize(param_name, ("w3", expert), up)
        return supplied

    def check_complete(self) -> None:
        if self.weights:
            names = sorted(self.weights)
            raise ModelLoadError(f"the checkpoint's FP8 weight(s) {', '.join(names[:5])} have no scale tensor: "
                                 f"{', '.join(n + SCALE_SUFFIX for n in names[:5])} missing")
        if self.scales:
            names = sorted(n + SCALE_SUFFIX for n in self.scales)
            raise ModelLoadError(f"the checkpoint holds scale(s) {', '.join(names[:5])} without their FP8 weights")
