"""The runner's encoder outputs, by content hash: one [num_embeds, D] tensor per media item,
computed the first time a step needs one of its rows and kept for later chunks of the same
request (chunked prefill splitting an image), for other requests with the same item, and for a
preempted request's recompute.

Capacity is in encoder rows. An entry still needed by a request the runner holds (its prefill
has not passed the item's span yet) is never evicted; others go least recently used first once
the cache holds more than its capacity. `num_computed_items` counts the items the encoder ran
for (tests and /metrics read it).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_rows: int):
        self.capacity_rows = capacity_rows
        self._outputs: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_computed_items = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._outputs

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def num_rows(self) -> int:
        return sum(t.shape[0] for t in self._outputs.values())

    def get(self, content_hash: str) -> torch.Tensor:
        self._outputs.move_to_end(content_hash)
        return self._outputs[content_hash]

    def put(self, content_hash: str, output: torch.Tensor) -> None:
        self._outputs[content_hash] = output
        self.num_computed_items += 1

    def evict(self, needed: set[str]) -> None:
        """Least recently used entries that no request needs, until within capacity."""
        rows = self.num_rows
        for content_hash in list(self._outputs):
            if rows <= self.capacity_rows:
                return
            if content_hash not in needed:
                rows -= self._outputs.pop(content_hash).shape[0]
