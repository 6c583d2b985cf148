"""Gather one small JSON-able dict from every rank, over a CPU (gloo) group: the lengths first
(one int64 each), then the bytes, padded to the longest. msgpack on the wire, never pickle.
Every rank of the group calls it at the same point."""

from __future__ import annotations

import msgpack
import torch
import torch.distributed as dist


def gather_dicts(group, mine: dict) -> list[dict]:
    """Every rank's dict, by rank, on every rank."""
    payload = msgpack.packb(mine, use_bin_type=True)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    longest = max(int(t.item()) for t in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return [msgpack.unpackb(part[:int(n.item())].numpy().tobytes(), raw=False, strict_map_key=False)
            for part, n in zip(parts, lengths)]
