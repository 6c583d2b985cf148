"""What a stateful layer keeps between steps, declared by the layer itself.

Two kinds of cache exist, and every stateful layer declares which it needs through
`cache_specs(cache_config)`; nothing else in the engine knows a cache's shape:

- a **paged** cache grows with the tokens of a request and is addressed through its block
  table: one tensor [planes, num_blocks, block_size, *token_shape] per spec (MHA K and V are two
  planes of [kv_heads, head_dim]; an MLA latent is one plane of [rank + rope_dim]);
- a **state** cache has a fixed size per request and is addressed by the request's state slot:
  one tensor [num_slots, *shape] per part (a Gated DeltaNet layer keeps a conv state and a
  recurrent state).

A stateful layer (`CachedLayer`) carries the model's layer number, `layer_index`: checkpoint
scales, `--kv-cache-dtype-skip-layers` and the reports name layers by it. The runner allocates
the tensors the specs describe (executor/cache_tensors.py) and hands each layer its own through
`bind_caches`, in the order of its specs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from metrale.config.cache_config import CacheConfig


@dataclass(frozen=True)
class PagedCacheSpec:
    kind: str  # the backend kind that reads it: "attention"
    planes: int  # leading planes sharing the block table (2 for K and V)
    token_shape: tuple[int, ...]  # one token's entry in one plane
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.planes * math.prod(self.token_shape) * self.dtype.itemsize

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.planes, num_blocks, block_size, *self.token_shape)

    def describe(self) -> str:
        return f"{self.planes} x {tuple(self.token_shape)} {str(self.dtype).removeprefix('torch.')} per token"


@dataclass(frozen=True)
class StateTensorSpec:
    name: str  # "conv", "recurrent"
    shape: tuple[int, ...]  # one request's state
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StateCacheSpec:
    kind: str  # the backend kind that reads it: "gdn"
    tensors: tuple[StateTensorSpec, ...]

    @property
    def bytes_per_slot(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> str:
        return ", ".join(f"{t.name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in self.tensors)


CacheSpec = PagedCacheSpec | StateCacheSpec


@runtime_checkable
class CachedLayer(Protocol):
    """A module that keeps something between steps (Attention, GatedDeltaNet, ...)."""

    layer_index: int

    def cache_specs(self, config: CacheConfig) -> tuple[CacheSpec, ...]: ...

    def bind_caches(self, caches: tuple[torch.Tensor, ...] | None) -> None:
        """The tensors of its specs, in their order (a paged spec's [planes, blocks, ...] tensor,
        then a state spec's parts), or None when the pool is released."""


def cached_layers(model: nn.Module) -> list[CachedLayer]:
    """The model's stateful modules, in model order. Two of one kind may not share a layer
    number: scales and skip lists would not know which one they name. A layer marked
    `drafter_only` (a multi-token-prediction layer's attention, models/mtp.py) has no cache yet."""
    layers = [m for m in model.modules() if isinstance(m, CachedLayer) and not getattr(m, "drafter_only", False)]
    seen: set[tuple[str, int]] = set()
    for layer in layers:
        key = (type(layer).__name__, layer.layer_index)
        if key in seen:
            raise ValueError(f"two {key[0]} modules claim model layer {key[1]}")
        seen.add(key)
    return layers
