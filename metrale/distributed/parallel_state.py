"""This process's place in the tensor-parallel group, and the collectives layers use.

Set once at startup by the launcher (`init_tensor_parallel`); a single process is rank 0 of 1
and every collective is the identity, so models never branch on the group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_TP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _TP


def init_tensor_parallel(rank: int, size: int, group=None) -> None:
    global _TP
    _TP = TensorParallelGroup(rank, size, group)
