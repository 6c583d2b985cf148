"""Pinned host buffers that a step's host-to-device copies reuse, step after step.

A step's index arrays go to the GPU through pinned host memory, so the copy can be issued without
blocking. Allocating that memory costs the host about 10-15 us per buffer (PyTorch's caching host
allocator queries the events of its cached blocks), and a verify step stages five or six of them.
`HostStaging` keeps a small ring of buffers per purpose instead.

Invariant: the host writes a buffer only after every copy that read it has run. Each copy records
an event, and handing the buffer out again waits on it. With `DEPTH` buffers per purpose, that copy
was issued `DEPTH` steps ago and has long finished, so the wait returns at once.

Only the host side is reused. The device copies are new tensors (or the caller's static buffers),
so nothing a step hands on aliases a buffer that a later step rewrites. Off CUDA nothing is pinned
and every buffer is new: there `tensor.to(cpu)` returns the tensor itself, which must not be reused.
"""

from __future__ import annotations

import torch

DEPTH = 3
_MIN_ELEMENTS = 256  # buffers grow in powers of two from here, so a ring settles after a few steps


class StagedCopy:
    """A host buffer to fill (`host`), then copy to the device once, with `copy_into` or `to`."""

    __slots__ = ("host", "_slot")

    def __init__(self, host: torch.Tensor, slot: list | None):
        self.host, self._slot = host, slot

    def copy_into(self, dest: torch.Tensor) -> None:
        dest.copy_(self.host, non_blocking=True)
        self._issued()

    def to(self, device: torch.device) -> torch.Tensor:
        out = self.host.to(device, non_blocking=True)
        self._issued()
        return out

    def _issued(self) -> None:
        if self._slot is not None:
            self._slot[1] = torch.cuda.Event()
            self._slot[1].record()


class HostStaging:
    def __init__(self, device: torch.device):
        self.pinned = device.type == "cuda"
        # purpose -> (next turn, [[buffer, event of its last copy or None], ...])
        self._rings: dict[str, tuple[int, list[list]]] = {}

    def take(self, purpose: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> StagedCopy:
        """A host buffer of `shape` for one copy; its contents are undefined until the caller writes them."""
        numel = 1
        for size in shape:
            numel *= size
        if not self.pinned:
            return StagedCopy(torch.empty(shape, dtype=dtype), None)
        turn, ring = self._rings.get(purpose, (0, None))
        if ring is None:
            ring = [[None, None] for _ in range(DEPTH)]
        self._rings[purpose] = ((turn + 1) % DEPTH, ring)
        slot = ring[turn]
        buffer, event = slot
        if event is not None:
            event.synchronize()
            slot[1] = None
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            size = max(_MIN_ELEMENTS, 1 << max(0, numel - 1).bit_length())
            buffer = slot[0] = torch.empty(size, dtype=dtype, pin_memory=True)
        return StagedCopy(buffer[:numel].view(shape), slot)
