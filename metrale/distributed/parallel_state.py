"""This process's place in the tensor-parallel, expert-parallel and world groups, and the
collectives layers use.

Set once at startup by the launcher (`metrale/distributed/launch.py`); a single process is rank
0 of 1 in every group and every collective is the identity, so models never branch on sizes.
Layers read their group when they are built (`get_tp_group()`), so the groups must be set before
the model is constructed and a model keeps the groups it was built with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


class OneShotAllReduce:
    """All-reduce of small CUDA messages through symmetric memory: every rank writes its input
    into a buffer all ranks can address, then each reads every peer's copy and sums (one round
    trip, no ring), which beats NCCL's ring on the few-KiB messages of a decode step.

    Messages over `max_bytes`, other dtypes, and anything off CUDA take NCCL's all-reduce. The
    path needs torch's symmetric memory (`torch.ops.symm_mem.one_shot_all_reduce`) and peer
    access between the GPUs; it has not been run on multi-GPU hardware in this project's tests.
    """

    DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, group, max_bytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def accepts(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype in self.DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[:x.numel() * x.element_size()].view(x.dtype)
        staged.copy_(x.reshape(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)
        x.copy_(out.view_as(x))
        return x


def make_oneshot_all_reduce(group, max_kb: int, device: torch.device) -> OneShotAllReduce | None:
    """The small-message path for `group`, or None (off, not CUDA, or symmetric memory missing).
    Collective over the group: every member calls it, in the same order."""
    if max_kb <= 0 or device.type != "cuda" or group is None:
        return None
    try:
        return OneShotAllReduce(group, max_kb * 1024, device)
    except Exception as e:  # noqa: BLE001 - any failure means the fallback, which always works
        logger.warning("one-shot all-reduce unavailable (%s); using NCCL's all-reduce for every size", e)
        return None


@dataclass(frozen=True)
class TensorParallelGroup:
    """One group of ranks (TP, EP or the world) and its collectives; size 1 is the identity."""

    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup when size > 1
    oneshot: OneShotAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns it."""
        if self.size == 1:
            return x
        if self.oneshot is not None and self.oneshot.accepts(x):
            return self.oneshot.all_reduce(x)
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


ParallelGroup = TensorParallelGroup

_TP = TensorParallelGroup()
_EP = TensorParallelGroup()
_WORLD = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _TP


def get_ep_group() -> TensorParallelGroup:
    return _EP


def get_world_group() -> TensorParallelGroup:
    return _WORLD


def init_tensor_parallel(rank: int, size: int, group=None, oneshot: OneShotAllReduce | None = None) -> None:
    global _TP
    _TP = TensorParallelGroup(rank, size, group, oneshot)


def init_expert_parallel(rank: int, size: int, group=None, oneshot: OneShotAllReduce | None = None) -> None:
    global _EP
    _EP = TensorParallelGroup(rank, size, group, oneshot)


def init_world_group(rank: int, size: int, group=None, oneshot: OneShotAllReduce | None = None) -> None:
    global _WORLD
    _WORLD = TensorParallelGroup(rank, size, group, oneshot)


def is_single_rank() -> bool:
    return _TP.size == 1 and _EP.size == 1 and _WORLD.size == 1


def reset_parallel_state() -> None:
    """Back to rank 0 of 1 everywhere (after a multi-rank engine shut down)."""
    global _TP, _EP, _WORLD
    _TP, _EP, _WORLD = TensorParallelGroup(), TensorParallelGroup(), TensorParallelGroup()
