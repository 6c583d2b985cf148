"""Put checkpoint tensors into a model's parameters, or random ones (`--load-format dummy`).

Checkpoint names map onto ours through the model's `stacked_params` (q/k/v into qkv_proj,
gate/up into gate_up_proj); each parameter's `weight_loader` takes this rank's slice. A tensor
the model needs but the checkpoint lacks is an error that names it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from metrale.config.model_config import ModelLoadError

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _default_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(loaded)


def _expected_pieces(model: nn.Module, params: dict[str, torch.Tensor]) -> set[tuple[str, object]]:
    stacked = getattr(model, "stacked_params", [])
    shards_of: dict[str, list] = {}
    for ours, _, shard in stacked:
        shards_of.setdefault(ours, []).append(shard)
    expected = set()
    for name in params:
        module_name = name.rsplit(".", 2)[-2] if "." in name else name
        for shard in shards_of.get(module_name, [None]):
            expected.add((name, shard))
    return expected


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], progress=None) -> None:
    if hasattr(model, "load_weights"):
        return model.load_weights(weights, progress)
    params = dict(model.named_parameters())
    stacked = getattr(model, "stacked_params", [])
    skip_lm_head = getattr(model, "tied_embeddings", False)
    loaded: set[tuple[str, object]] = set()
    for name, tensor in weights:
        if progress is not None:
            progress.update(1)
        if name.endswith(_IGNORED_SUFFIXES) or (skip_lm_head and name.startswith("lm_head.")):
            continue
        target, shard = name, None
        for ours, theirs, shard_id in stacked:
            if f".{theirs}." in name:
                target, shard = name.replace(f".{theirs}.", f".{ours}."), shard_id
                break
        param = params.get(target)
        if param is None:
            logger.warning("ignoring checkpoint tensor %s: the model has no such parameter", name)
            continue
        loader = getattr(param, "weight_loader", _default_loader)
        try:
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
        except ValueError as e:
            raise ModelLoadError(f"checkpoint tensor {name}: {e}") from None
        loaded.add((target, shard))
    missing = _expected_pieces(model, params) - loaded
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise ModelLoadError(f"the checkpoint is missing {len(names)} tensor(s) the model needs, e.g. "
                             f"{', '.join(names[:5])}")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes and dtypes, drawn on the parameters' own device; norms
    stay at one. For benchmarks: they cost the same time as real weights."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[0].endswith("norm"):
            param.data.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.uniform_(-0.02, 0.02, generator=generators[param.device])
