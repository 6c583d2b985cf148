"""Arrival counters: the last program of a group does the group's reduction, in the same launch.

A kernel whose output needs values from several programs (the k partials of a token's experts,
a token's router logits) can skip a second launch: each program stores its part, counts itself
in at its group's counter (`tl.atomic_add(..., sem="acq_rel")` after a barrier, so that every
thread's stores are published first), and the program that finds the count at `group size - 1`
reads the parts back (`cache_modifier=".cg"`: from L2), reduces them in a fixed order and sets
the counter back to zero. Which program arrives last decides who reduces, never the order of the
reduction, so results stay deterministic.

Invariant: between launches every counter is zero. The counters are one int32 buffer per device,
shared by every kernel that uses them, so their launches on one device must not overlap (one
stream per device, as the engine runs).
"""

from __future__ import annotations

import torch

MIN_COUNTERS = 16 * 1024

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 counters at zero on `device`. Allocated (and zeroed) on first use
    and when more are needed, never while a CUDA graph is captured (the capture would not run the
    zero fill): run the same shapes once before capturing, as warm-up does."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{count} arrival counters are needed while a CUDA graph is captured; "
                               "run the same batch size once before the capture")
        counters = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters
