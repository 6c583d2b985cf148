"""The cache layout: every stateful layer's specs, gathered once from the model, and the sizes
that follow from them. The memory plan, the allocation (cache_tensors.py), `GET /memory`,
`met memory-plan` and the warm-up all read sizes from here; nothing else multiplies shapes.

- bytes per token / per block: the paged specs of every layer (all share one block table);
- bytes per slot: the state specs of every layer (one slot holds one request's whole state).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from metrale.config.cache_config import CacheConfig
from metrale.config.errors import OptionError
from metrale.layers.cache_spec import CacheSpec, PagedCacheSpec, StateCacheSpec, cached_layers


@dataclass(frozen=True)
class LayerCaches:
    layer_index: int  # the model's layer number
    specs: tuple[CacheSpec, ...]


@dataclass(frozen=True)
class CacheLayout:
    block_size: int
    layers: tuple[LayerCaches, ...]  # in model order, as cached_layers(model) lists them, then a drafter's

    @classmethod
    def of(cls, model: nn.Module, config: CacheConfig, drafter_layers=()) -> "CacheLayout":
        """`drafter_layers`: a runner-side drafter's stateful modules (executor/drafters/base.py),
        after the model's."""
        layers = cached_layers(model) + list(drafter_layers)
        layout = cls(config.block_size, tuple(LayerCaches(layer.layer_index, tuple(layer.cache_specs(config)))
                                              for layer in layers))
        if config.indexer_cache_dtype == "fp8" and "indexer" not in layout.kinds:
            architecture = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
            raise OptionError(f"--indexer-cache-dtype fp8: {architecture} has no DSA indexer, so no indexer "
                              f"cache to store in fp8; leave it at auto")
        return layout

    def _specs(self, spec_type) -> list:
        return [spec for layer in self.layers for spec in layer.specs if isinstance(spec, spec_type)]

    @property
    def bytes_per_token(self) -> int:
        return sum(spec.bytes_per_token for spec in self._specs(PagedCacheSpec))

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def bytes_per_slot(self) -> int:
        return sum(spec.bytes_per_slot for spec in self._specs(StateCacheSpec))

    @functools.cached_property  # read on every step; the layout never changes
    def has_state(self) -> bool:
        return bool(self._specs(StateCacheSpec))

    @property
    def kinds(self) -> list[str]:
        return sorted({spec.kind for layer in self.layers for spec in layer.specs})

    def summary(self) -> list[str]:
        """One line per (kind, spec shape): which model layers, and the bytes."""
        groups: dict[tuple, list[int]] = {}
        for layer in self.layers:
            for spec in layer.specs:
                groups.setdefault((spec.kind, spec.describe(), type(spec)), []).append(layer.layer_index)
        lines = []
        for (kind, described, spec_type), indices in groups.items():
            spec = next(s for layer in self.layers for s in layer.specs
                        if s.kind == kind and s.describe() == described)
            unit = (f"{spec.bytes_per_token:,} B/token" if spec_type is PagedCacheSpec
                    else f"{spec.bytes_per_slot:,} B/request")
            lines.append(f"{kind}: {len(indices)} layer(s) {_ranges(indices)}, {described} ({unit} each)")
        return lines


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    parts, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)
