"""Checkpoint tensors into a model that has FusedMoE layers.

Per-expert checkpoint tensors (`...experts.{e}.gate_proj.weight`, `...experts.{e}.w1.weight`, ...)
and transformers' stacked ones (`...experts.gate_up_proj`, `...experts.down_proj`) go to the
layer's `w13` / `w2` through its `weight_loader(param, tensor, shard_id, expert_id)`; everything
else maps as in the generic loader (the model's `stacked_params` for q/k/v and gate/up). A
piece this rank needs but the checkpoint lacks is an error that names it, down to the expert.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from metrale.config.model_config import ModelLoadError
from metrale.layers.moe.layer import EXPERT_SHARD_OF, STACKED_SHARD_OF, FusedMoE

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def expert_target(name: str) -> tuple[str, str, int | None] | None:
    """Checkpoint name -> (our parameter, shard id, expert id or None if stacked), or None."""
    match = _PER_EXPERT.match(name)
    if match and match["proj"] in EXPERT_SHARD_OF:
        shard = EXPERT_SHARD_OF[match["proj"]]
        return f"{match['prefix']}.{'w2' if shard == 'w2' else 'w13'}", shard, int(match["expert"])
    match = _STACKED.match(name)
    if match:
        shard = STACKED_SHARD_OF[match["proj"]]
        return f"{match['prefix']}.{'w13' if shard == 'w13' else 'w2'}", shard, None
    return None


def _expert_pieces(param_name: str, layer: FusedMoE, shard: str, expert: int | None) -> set:
    experts = range(*layer.expert_range) if expert is None else [expert] if layer.holds_expert(expert) else []
    shards = ("w1", "w3") if shard == "w13" else (shard,)
    return {(param_name, (s, e)) for e in experts for s in shards}


def _expected_pieces(model: nn.Module, params: dict, moe_params: dict) -> set:
    shards_of: dict[str, list] = {}
    for ours, _, shard in getattr(model, "stacked_params", []):
        shards_of.setdefault(ours, []).append(shard)
    expected = set()
    for name in params:
        if name in moe_params:
            expected |= _expert_pieces(name, moe_params[name], "w2" if name.endswith(".w2") else "w13", None)
            continue
        module_name = name.rsplit(".", 2)[-2] if "." in name else name
        expected |= {(name, shard) for shard in shards_of.get(module_name, [None])}
    return expected


def _default_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_moe_model_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], progress=None,
                           renames: Iterable[tuple[str, str]] = ()) -> None:
    """`renames`: (checkpoint substring, ours) replacements applied in order before mapping."""
    params = dict(model.named_parameters())
    moe_params = {f"{prefix}.{p}": layer for prefix, layer in model.named_modules()
                  if isinstance(layer, FusedMoE) for p in ("w13", "w2")}
    stacked = getattr(model, "stacked_params", [])
    skip_lm_head = getattr(model, "tied_embeddings", False)
    loaded: set = set()
    for checkpoint_name, tensor in weights:
        if progress is not None:
            progress.update(1)
        name = checkpoint_name
        for theirs, ours in renames:
            name = name.replace(theirs, ours)
        if name.endswith(_IGNORED_SUFFIXES) or (skip_lm_head and name.startswith("lm_head.")):
            continue
        try:
            target = expert_target(name)
            if target is not None and target[0] in moe_params:
                param_name, shard, expert = target
                layer = moe_params[param_name]
                layer.weight_loader(params[param_name], tensor, shard, expert)
                loaded |= _expert_pieces(param_name, layer, shard, expert)
                continue
            target_name, shard = name, None
            for ours, theirs, shard_id in stacked:
                if f".{theirs}." in name:
                    target_name, shard = name.replace(f".{theirs}.", f".{ours}."), shard_id
                    break
            param = params.get(target_name)
            if param is None:
                logger.warning("ignoring checkpoint tensor %s: the model has no such parameter", checkpoint_name)
                continue
            loader = getattr(param, "weight_loader", _default_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
        except ValueError as e:
            raise ModelLoadError(f"checkpoint tensor {checkpoint_name}: {e}") from None
        loaded.add((target_name, shard))
    missing = _expected_pieces(model, params, moe_params) - loaded
    if missing:
        names = sorted(_describe(n, s) for n, s in missing)
        raise ModelLoadError(f"the checkpoint is missing {len(names)} tensor(s) the model needs, e.g. "
                             f"{', '.join(names[:5])}")


def _describe(name: str, shard) -> str:
    if isinstance(shard, tuple):
        return f"{name}[{shard[0]}, expert {shard[1]}]"
    return f"{name}[{shard}]" if shard is not None else name
