"""The serve topology: how many tensor-parallel (TP) and expert-parallel (EP) ranks there are,
and where one global rank sits among them. Pure rules, no torch, no processes.

Rules (docs/parallel.md):

- `--tp-size 1 --ep-size 1` with a world above 1 makes every rank an EP rank (ep = world).
- The world is either an orthogonal mesh, world = tp x ep, or overlapping groups,
  world = tp = ep (the same ranks split attention by heads and the experts by range).
- Left at 1, the world size is derived from the sizes: tp when tp == ep (overlapping),
  tp x ep otherwise. The derived value is logged. Any other combination is an error that
  names the sizes.

Rank placement:

- orthogonal mesh: tp_rank = rank % tp_size, ep_rank = rank // tp_size, so the ranks of one
  TP group are consecutive (on one host they share the fastest links) and an EP group takes
  one rank from each TP group;
- overlapping groups: tp_rank = ep_rank = rank, and the TP group is the EP group is the world.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from metrale.config.errors import StartupError
from metrale.distributed.head_split import attention_split

logger = logging.getLogger(__name__)


class TopologyError(StartupError, ValueError):
    """The parallel sizes do not form a valid topology, or the model cannot be split over it."""


@dataclass(frozen=True)
class Topology:
    world_size: int
    tp_size: int
    ep_size: int
    tp_rank: int
    ep_rank: int
    rank: int = 0

    @property
    def overlapping(self) -> bool:
        """TP and EP groups are the same ranks (world = tp = ep > 1)."""
        return self.world_size > 1 and self.tp_size == self.ep_size == self.world_size

    def tp_group_ranks(self) -> list[list[int]]:
        """Every TP group as its global ranks, in the order every rank must create them."""
        if self.overlapping:
            return [list(range(self.world_size))]
        return [[e * self.tp_size + t for t in range(self.tp_size)] for e in range(self.ep_size)]

    def ep_group_ranks(self) -> list[list[int]]:
        """Every EP group as its global ranks, in the order every rank must create them."""
        if self.overlapping:
            return [list(range(self.world_size))]
        return [[e * self.tp_size + t for e in range(self.ep_size)] for t in range(self.tp_size)]

    def describe(self) -> str:
        kind = "overlapping" if self.overlapping else "mesh" if self.world_size > 1 else "single"
        return (f"rank {self.rank}/{self.world_size} ({kind}): tp_rank {self.tp_rank}/{self.tp_size}, "
                f"ep_rank {self.ep_rank}/{self.ep_size}")


def parallel_sizes(tp_size: int, ep_size: int, world_size: int) -> tuple[int, int, int]:
    """(tp, ep, derived world): the sizes as the rules read them, and the world they imply."""
    if tp_size <= 1 and ep_size <= 1 and world_size > 1:
        tp, ep = 1, world_size
    else:
        tp, ep = max(1, tp_size), max(1, ep_size)
    return tp, ep, tp if tp == ep else tp * ep


def resolve_topology(tp_size: int, ep_size: int, world_size: int = 1, rank: int = 0) -> Topology:
    tp, ep, derived = parallel_sizes(tp_size, ep_size, world_size)
    world = world_size
    if world_size <= 1 and (tp > 1 or ep > 1):
        world = derived
        logger.info("world size %d derived from --tp-size %d --ep-size %d (tp == ep: overlapping groups, "
                    "world = tp; otherwise an orthogonal mesh, world = tp x ep); pass --world-size to set it",
                    world, tp, ep)
    world = max(1, world)
    if not 0 <= rank < world:
        raise TopologyError(f"rank {rank} is outside a world of {world} ranks (0..{world - 1})")
    if world > 1 and tp == ep == world:
        tp_rank, ep_rank = rank, rank
    elif world == tp * ep:
        tp_rank, ep_rank = rank % tp, rank // tp
    else:
        raise TopologyError(
            f"invalid parallel topology: world_size={world}, but tp_size={tp} x ep_size={ep} = {tp * ep}. "
            f"Use an orthogonal mesh (world_size = tp_size x ep_size) or overlapping groups "
            f"(world_size = tp_size = ep_size).")
    return Topology(world, tp, ep, tp_rank, ep_rank, rank)


def check_expert_layout(topology: Topology, expert_layout: str) -> None:
    """`--moe-expert-layout tp` slices every expert over the TP group; with EP ranks outside that
    group (an orthogonal mesh with ep > 1) their experts would be summed twice, so it is refused."""
    if expert_layout not in ("ep", "tp"):
        raise TopologyError(f"unknown MoE expert layout {expert_layout!r}; expected ep or tp")
    if expert_layout == "tp" and topology.ep_size > 1 and not topology.overlapping:
        raise TopologyError(
            f"--moe-expert-layout tp slices every expert over the TP ranks and needs ep_size 1 or "
            f"tp_size = ep_size = world_size; got tp_size={topology.tp_size}, ep_size={topology.ep_size}, "
            f"world_size={topology.world_size}. Use --moe-expert-layout ep.")


def check_attention_heads(architecture: str, num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Attention heads split over the TP ranks by distributed/head_split.py's rules: evenly where
    they divide, else as evenly as possible in whole KV groups; KV heads fewer than the ranks are
    replicated on tp_size / num_kv_heads ranks (which must divide)."""
    if tp_size <= 1:
        return
    try:
        attention_split(num_heads, num_kv_heads, tp_size)
    except ValueError as e:
        raise TopologyError(f"{architecture}: {e}") from None
