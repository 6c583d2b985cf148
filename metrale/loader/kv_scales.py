"""FP8 KV-cache scales carried by a checkpoint (`...layers.N.self_attn.k_scale`, or under
`k_proj` / `attn`, as vLLM and llm-compressor write them): taken out of the tensor stream and
set on the N-th attention layer."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

_SCALE = re.compile(r"layers\.(\d+)\..*\b([kv])_scale$")


def take_kv_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    from metrale.layers.attention.layer import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for name, tensor in weights:
        match = _SCALE.search(name)
        if match is None:
            yield name, tensor
            continue
        layer = layers[int(match.group(1))]
        setattr(layer, f"{match.group(2)}_scale", float(tensor.float().max()))
