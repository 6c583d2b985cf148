"""Where this rank's experts and intermediate slice come from, for the FusedMoE layer.

Two ways to split a MoE layer over ranks that all see the same tokens, both ending in one
all-reduce of the layer's partial output over the layout's `reduce_group`:

- tensor parallel (the default): every rank holds every expert, each with a contiguous
  1/tp_size slice of the intermediate dimension (rows of w1/w3, columns of w2);
- expert parallel: rank r holds the whole of a contiguous range of experts
  [r * E // size, (r + 1) * E // size); tokens routed elsewhere contribute zero locally.

Both can combine (an orthogonal tp x ep mesh). The launcher sets the layout once
(`init_moe_layout`, from `layout_for_topology`); until then it follows the TP group. A single
process is rank 0 of 1 either way, so models never branch on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.distributed import parallel_state
from metrale.distributed.parallel_state import TensorParallelGroup, get_tp_group
from metrale.distributed.topology import Topology


@dataclass(frozen=True)
class MoEParallelLayout:
    tp_rank: int = 0  # slice of each expert's intermediate dimension
    tp_size: int = 1
    ep_rank: int = 0  # contiguous range of experts
    ep_size: int = 1
    # Partial outputs (intermediate slices or expert subsets) are summed over this group.
    reduce_group: TensorParallelGroup = field(default_factory=TensorParallelGroup)

    def __post_init__(self):
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.ep_rank < self.ep_size):
            raise ValueError(f"invalid MoE layout: tp {self.tp_rank}/{self.tp_size}, ep {self.ep_rank}/{self.ep_size}")

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[start, end) of the global expert ids this rank holds."""
        if num_experts < self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over {self.ep_size} expert-parallel ranks")
        return self.ep_rank * num_experts // self.ep_size, (self.ep_rank + 1) * num_experts // self.ep_size

    def intermediate_slice(self, intermediate_size: int) -> tuple[int, int]:
        """[start, end) of each expert's intermediate dimension this rank holds."""
        if intermediate_size % self.tp_size:
            raise ValueError(f"expert intermediate size ({intermediate_size}) is not divisible by the "
                             f"tensor-parallel size ({self.tp_size})")
        local = intermediate_size // self.tp_size
        return self.tp_rank * local, (self.tp_rank + 1) * local


_LAYOUT: MoEParallelLayout | None = None


def get_moe_layout() -> MoEParallelLayout:
    """The layout set at startup (`init_moe_layout`), else every expert sliced over the TP group
    (which, for a single process, is the whole layer on rank 0 of 1)."""
    if _LAYOUT is not None:
        return _LAYOUT
    tp = get_tp_group()
    return MoEParallelLayout(tp_rank=tp.rank, tp_size=tp.size, reduce_group=tp)


def init_moe_layout(layout: MoEParallelLayout | None) -> None:
    """Set once by the launcher before the model is built; None goes back to the default."""
    global _LAYOUT
    _LAYOUT = layout


def layout_for_topology(tp_rank: int, tp_size: int, ep_rank: int, ep_size: int, expert_layout: str = "ep",
                        reduce_group: TensorParallelGroup | None = None,
                        world_size: int | None = None) -> MoEParallelLayout:
    """The MoE layout of one rank of a serve topology (EngineArgs tp_size, ep_size, moe_expert_layout).

    - overlapping groups (tp == ep == world > 1; `world_size` defaults to tp_size, the overlapping
      case), layout "ep": rank r owns expert range r, whole;
    - any topology, layout "tp" (needs ep_size 1 or overlapping groups): every expert on every
      rank, its intermediate dimension sliced over the TP ranks;
    - orthogonal mesh (world = tp x ep), layout "ep": the EP rank picks the expert range and the
      TP rank slices inside it.
    `reduce_group` must span every rank whose partial output belongs to the sum: the TP group for
    overlapping groups, the whole world for a mesh. Tokens must be the same on all of them."""
    group = reduce_group or get_tp_group()
    world_size = tp_size if world_size is None else world_size
    overlapping = tp_size == ep_size == world_size > 1  # tp == ep in a world of tp x ep is a mesh
    if expert_layout == "tp":
        if ep_size > 1 and not overlapping:
            raise ValueError(f"MoE expert layout tp needs ep_size 1 or ep_size == tp_size; got tp {tp_size}, "
                             f"ep {ep_size}. Use the ep layout.")
        return MoEParallelLayout(tp_rank=tp_rank, tp_size=tp_size, reduce_group=group)
    if expert_layout != "ep":
        raise ValueError(f"unknown MoE expert layout {expert_layout!r}; expected ep or tp")
    if overlapping:
        return MoEParallelLayout(ep_rank=ep_rank, ep_size=ep_size, reduce_group=group)
    return MoEParallelLayout(tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size, reduce_group=group)


def moe_reduce_group(topology: Topology, expert_layout: str) -> TensorParallelGroup:
    """The group over which a MoE layer's partial outputs are summed: every rank that holds a
    different part of the same layer, and no other (else a part would be counted twice).
    Layout tp, or no EP beside TP, or overlapping groups: the TP group; EP only: the EP group;
    an orthogonal mesh with layout ep (experts by EP rank, sliced by TP rank): the world."""
    if expert_layout == "tp" or topology.overlapping or topology.ep_size == 1:
        return parallel_state.get_tp_group()
    if topology.tp_size == 1:
        return parallel_state.get_ep_group()
    return parallel_state.get_world_group()


def moe_layout(topology: Topology, expert_layout: str) -> MoEParallelLayout:
    """This rank's MoEParallelLayout, summed over the group the layout needs."""
    return layout_for_topology(topology.tp_rank, topology.tp_size, topology.ep_rank, topology.ep_size,
                               expert_layout, moe_reduce_group(topology, expert_layout), topology.world_size)
