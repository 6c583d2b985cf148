"""Where this rank's experts and intermediate slice come from, for the FusedMoE layer.

Two ways to split a MoE layer over the ranks of the tensor-parallel group, both ending in one
all-reduce of the layer's partial output over that group:

- tensor parallel (the default): every rank holds every expert, each with a contiguous
  1/tp_size slice of the intermediate dimension (rows of w1/w3, columns of w2);
- expert parallel: rank r holds the whole of a contiguous range of experts
  [r * E // size, (r + 1) * E // size); tokens routed elsewhere contribute zero locally.

A single process is rank 0 of 1 in both, so models never branch on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.distributed.parallel_state import TensorParallelGroup, get_tp_group


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


def get_moe_layout(expert_parallel: bool = False) -> MoEParallelLayout:
    """This process's MoE layout from the tensor-parallel group: the group's ranks either slice
    every expert (default) or own disjoint ranges of whole experts (`expert_parallel`)."""
    tp = get_tp_group()
    if expert_parallel:
        return MoEParallelLayout(ep_rank=tp.rank, ep_size=tp.size, reduce_group=tp)
    return MoEParallelLayout(tp_rank=tp.rank, tp_size=tp.size, reduce_group=tp)
