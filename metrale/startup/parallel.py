"""Above one rank: refuse a model the topology cannot split, then join (or start) the ranks."""

from __future__ import annotations

import logging
import re

import torch

from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelConfig
from metrale.distributed.head_split import attention_split, is_uneven, per_rank
from metrale.distributed.launch import (ParallelRuntime, ensure_no_live_groups, join_ranks, shard_sizes_of,
                                        topology_from_args)
from metrale.distributed.rank_access import is_loopback
from metrale.distributed.topology import Topology, TopologyError, check_attention_heads, check_expert_layout
from metrale.models.registry import get_model_class

logger = logging.getLogger(__name__)


def check_model_split(config: ModelConfig, topology: Topology, expert_layout: str) -> None:
    """Refuse, before any process starts, a model this topology cannot split: the head counts,
    then a dry build on the meta device with this rank's shard sizes (expert ranges, intermediate
    slices, linear-attention heads), whose complaints are given the architecture and the sizes.
    Heads that split unevenly are logged from that build (`log_uneven_head_splits`)."""
    check_expert_layout(topology, expert_layout)
    check_attention_heads(config.architecture, config.num_attention_heads, config.num_kv_heads, topology.tp_size)
    try:
        with shard_sizes_of(topology, expert_layout), torch.device("meta"):
            model = get_model_class(config.architecture)(config)
    except ValueError as e:
        raise TopologyError(f"{config.architecture} cannot be split over tp_size={topology.tp_size}, "
                            f"ep_size={topology.ep_size} (--moe-expert-layout {expert_layout}): {e}") from None
    if topology.rank == 0:  # every rank checks its split; one says so
        log_uneven_head_splits(model, topology.tp_size)


def log_uneven_head_splits(model: torch.nn.Module, tp_size: int) -> None:
    """One line per distinct uneven split: the layers' names (model layer numbers folded into a
    list) and the heads each rank holds. Layers that split heads answer `uneven_head_split()`."""
    layers_by_split: dict[tuple[str, str], list[int]] = {}
    for name, module in model.named_modules():
        describe = getattr(module, "uneven_head_split", None)
        split = describe() if callable(describe) else None
        if split is None:
            continue
        match = _LAYER_NUMBER.search(name)
        pattern = _LAYER_NUMBER.sub(".layers.*.", name) if match else name
        layers_by_split.setdefault((pattern, split), []).append(int(match.group(1)) if match else -1)
    for (pattern, split), numbers in layers_by_split.items():
        where = "" if numbers == [-1] else f" in {len(numbers)} layer(s) {_ranges(numbers)}"
        logger.info("Uneven TP head split over tp_size=%d: %s%s: %s", tp_size, pattern, where, split)


_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def start_parallel(args: EngineArgs, config: ModelConfig, device: torch.device,
                   spawned: bool = False) -> ParallelRuntime | None:
    """Resolve the topology and, above one rank, check the split and join the other ranks.
    Returns None for a single rank."""
    topology, env = topology_from_args(args)
    ensure_no_live_groups(topology.world_size)
    if topology.world_size == 1:
        return None
    check_model_split(config, topology, args.moe_expert_layout)
    if topology.tp_size > 1:
        logger.info("TP-local head counts: %s", local_head_counts(config, topology.tp_size))
    return join_ranks(args, topology, env, device, spawned)


def ranks_started_here(args: EngineArgs, spawned: bool = False) -> int:
    """The ranks that will compute on this host beside this process and share its cores: a
    one-host launch's rank 0 starts them all; any other rank is one of them."""
    topology, env = topology_from_args(args)
    one_host_rank_0 = env is None and not spawned and topology.rank == 0 and is_loopback(args.master_addr)
    return topology.world_size if one_host_rank_0 else 1


def local_head_counts(config: ModelConfig, tp_size: int) -> str:
    """Each rank's share of the attention and linear-attention heads (KV heads replicated when
    fewer than the ranks); an uneven share prints per rank (2/2/1)."""
    hf = config.hf_config
    split = attention_split(config.num_attention_heads, config.num_kv_heads, tp_size)
    counts = {"num_attention_heads": split.q_heads, "num_key_value_heads": split.kv_heads}
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        if getattr(hf, name, None):
            counts[name] = (getattr(hf, name) // tp_size,)
    return ", ".join(f"{name}={per_rank(value) if is_uneven(value) else value[0]}" for name, value in counts.items())
