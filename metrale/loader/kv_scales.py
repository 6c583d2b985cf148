"""FP8 KV-cache scales carried by a checkpoint (`...layers.N.self_attn.k_scale`, or under
`k_proj` / `attn`, as vLLM and llm-compressor write them): taken out of the tensor stream and
set on the attention layer of model layer N (whatever the other layers are: in a hybrid model
attention layer N is not the N-th attention layer). An MLA layer keeps one latent plane: its
k_scale scales the whole latent (as vLLM reads such checkpoints), its v_scale is dropped."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from metrale.config.model_config import ModelLoadError
from metrale.layers.attention.layer import Attention
from metrale.layers.mla.layer import MLAAttention

_SCALE = re.compile(r"layers\.(\d+)\..*\b([kv])_scale$")


def take_kv_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    by_layer = {m.layer_index: m for m in model.modules() if isinstance(m, (Attention, MLAAttention))}
    for name, tensor in weights:
        match = _SCALE.search(name)
        if match is None:
            yield name, tensor
            continue
        layer = by_layer.get(int(match.group(1)))
        if layer is None:
            raise ModelLoadError(f"checkpoint tensor {name}: model layer {match.group(1)} has no attention "
                                 f"to take a KV scale")
        if isinstance(layer, MLAAttention):
            if match.group(2) == "k":
                layer.latent_scale = float(tensor.float().max())
            continue
        setattr(layer, f"{match.group(2)}_scale", float(tensor.float().max()))
