"""The backend interface every kind of cache shares, and the registry of backends by
(kind, name).

A backend turns the step's common BatchLayout into the metadata its layers read
(`build_metadata`), and does the kind's computation over its cache (each kind has its own
methods: attention writes K/V and attends, a Gated DeltaNet backend convolves and runs the delta
rule). The PyTorch backend of every kind ("torch") is its reference and runs anywhere; faster
ones ("triton") are tested against it.

CUDA graphs: the decode graphs capture a forward over static layout buffers, so a backend that
says `supports_cuda_graphs` builds its metadata from the layout's tensors alone (views, no host
reads of device values, nothing that changes between replays).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from metrale.layers.forward_context import BatchLayout

# kind -> the modules that define its backends (imported when that kind is first asked for)
_MODULES = {
    "attention": {"torch": "metrale.layers.attention.torch_backend",
                  "triton": "metrale.layers.attention.triton_backend"},
    "gdn": {"torch": "metrale.layers.linear_attention.torch_backend",
            "triton": "metrale.layers.linear_attention.triton_backend"},
}
_REGISTRY: dict[tuple[str, str], type["CacheBackend"]] = {}


class CacheBackend(ABC):
    kind: str = "abstract"
    name: str = "abstract"
    supports_cuda_graphs: bool = False

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> object:
        """What this kind's layers read for one step."""


def register_backend(cls: type[CacheBackend]) -> type[CacheBackend]:
    _REGISTRY[(cls.kind, cls.name)] = cls
    return cls


def backend_names(kind: str) -> list[str]:
    return sorted(_MODULES.get(kind, {}))


def get_backend(kind: str, name: str, device: torch.device) -> CacheBackend:
    """`auto`: Triton on CUDA when it imports, else the PyTorch reference."""
    if kind not in _MODULES:
        raise ValueError(f"no backend serves cache kind {kind!r}; known kinds: {', '.join(sorted(_MODULES))}")
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            try:
                importlib.import_module(_MODULES[kind]["triton"])
                name = "triton"
            except ImportError:
                pass
    if name not in _MODULES[kind]:
        raise ValueError(f"{kind} backend {name!r} does not exist; available: {', '.join(backend_names(kind))}")
    importlib.import_module(_MODULES[kind][name])  # registers it (ImportError: its dependency is missing)
    return _REGISTRY[(kind, name)]()
