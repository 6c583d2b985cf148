"""Checkpoint names of MoE experts: per-expert tensors (`...experts.{e}.gate_proj.weight`,
`...experts.{e}.w1.weight`, ...) and transformers' stacked ones (`...experts.gate_up_proj`,
`...experts.down_proj`) map to a FusedMoE layer's `w13` / `w2` (loader/weights.py uses these)."""

from __future__ import annotations

import re

from metrale.layers.moe.layer import EXPERT_SHARD_OF, STACKED_SHARD_OF, FusedMoE

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


def expert_pieces(param_name: str, layer: FusedMoE, shard: str, expert: int | None) -> set:
    """The (parameter, (shard, expert)) pieces one expert tensor supplies on this rank."""
    experts = range(*layer.expert_range) if expert is None else [expert] if layer.holds_expert(expert) else []
    shards = ("w1", "w3") if shard == "w13" else (shard,)
    return {(param_name, (s, e)) for e in experts for s in shards}
