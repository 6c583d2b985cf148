"""The cache tensors of every stateful layer: allocated from the layout, bound to their layers,
copied and released here, and nowhere else.

Paged specs get [planes, num_blocks, block_size, *token_shape] (dimension 1 indexes blocks);
state specs get [num_slots, *shape] per part, zeroed. The last slot is the padding slot: never
given to a request, it absorbs the reads and writes of the rows a CUDA graph pads a batch with.
With speculative decoding, the slots before it include max_num_seqs x k scratch rows, where a
verify step keeps the state after each draft (the runner places them, `keep_accepted_states`
selects from them).
"""

from __future__ import annotations

import torch

from metrale.executor.cache_layout import CacheLayout
from metrale.layers.cache_spec import CachedLayer, PagedCacheSpec
from metrale.layers.linear_attention.draft_states import keep_accepted_states


class CacheTensors:
    def __init__(self, layers: list[CachedLayer], layout: CacheLayout, num_blocks: int, num_slots: int,
                 device: torch.device):
        """`num_slots` counts the padding slot: requests use slots 0..num_slots-2."""
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.paged: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []
        self._layers = layers
        for layer, entry in zip(layers, layout.layers):
            tensors = []
            for spec in entry.specs:
                if isinstance(spec, PagedCacheSpec):
                    cache = torch.empty(spec.shape(num_blocks, layout.block_size), dtype=spec.dtype, device=device)
                    self.paged.append(cache)
                    tensors.append(cache)
                else:
                    for part in spec.tensors:
                        state = torch.zeros((num_slots, *part.shape), dtype=part.dtype, device=device)
                        self.states.append(state)
                        tensors.append(state)
            layer.bind_caches(tuple(tensors))

    @property
    def padding_slot(self) -> int:
        return self.num_slots - 1

    @property
    def paged_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.paged)

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.states)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block contents source -> destination in every paged cache (blocks are dimension 1)."""
        for cache, sources, destinations in _each(self.paged, pairs):
            cache[:, destinations] = cache[:, sources]

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """A request's whole state, slot source -> destination, in every state cache."""
        for state, sources, destinations in _each(self.states, pairs):
            state[destinations] = state[sources]

    def keep_accepted_states(self, slots: torch.Tensor, rows: torch.Tensor, num_drafts: torch.Tensor,
                             num_accepted: torch.Tensor) -> None:
        """After a verify step: each drafted request's slot takes the state of its last accepted
        position, in every state cache (layers/linear_attention/draft_states.py)."""
        keep_accepted_states(self.states, slots, rows, num_drafts, num_accepted)

    def release(self) -> None:
        for layer in self._layers:
            layer.bind_caches(None)
        self.paged, self.states = [], []



def _each(tensors: list[torch.Tensor], pairs: list[tuple[int, int]]):
    """(tensor, source ids, destination ids) for every tensor, the ids on their device."""
    if not pairs or not tensors:
        return
    device = tensors[0].device
    sources = torch.tensor([s for s, _ in pairs], device=device)
    destinations = torch.tensor([d for _, d in pairs], device=device)
    for tensor in tensors:
        yield tensor, sources, destinations
