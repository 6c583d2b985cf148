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
    "kda": {"torch": "metrale.layers.linear_attention.kda_torch_backend"},  # GLM-5.3's KDA, no Triton yet
    "mla": {"torch": "metrale.layers.mla.torch_backend",
            "triton": "metrale.layers.mla.triton_backend"},
    "indexer": {"torch": "metrale.layers.mla.indexer_torch_backend",  # DSA's indexer keys (layers/mla/indexer.py)
                "triton": "metrale.layers.mla.indexer_triton_backend"},
    # GLM-5.3's indexer over pooled index groups (layers/mla/indexer_pooling.py), no Triton yet
    "pooled_indexer": {"torch": "metrale.layers.mla.indexer_pooled_torch_backend"},
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
    return sorted(set(_MODULES.get(kind, {})) | {name for k, name in _REGISTRY if k == kind})


def _load(kind: str, name: str) -> bool:
    """Import the module of a backend (which registers it); False when its dependency is missing."""
    if (kind, name) in _REGISTRY:
        return True
    module = _MODULES.get(kind, {}).get(name)
    if module is None:
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return (kind, name) in _REGISTRY


def get_backend(kind: str, name: str, device: torch.device) -> CacheBackend:
    """`auto`: Triton on CUDA when it imports, else the PyTorch reference; `kernels`: Triton on
    any device where the kind has a Triton backend (the interpreter's `--forward eager` on the
    CPU), else the reference."""
    if not backend_names(kind):
        raise ValueError(f"no backend serves cache kind {kind!r}; known kinds: {', '.join(sorted(_MODULES))}")
    if name in ("auto", "kernels"):
        name = "triton" if (device.type == "cuda" or name == "kernels") and _load(kind, "triton") else "torch"
    if name not in backend_names(kind):
        raise ValueError(f"{kind} backend {name!r} does not exist; available: {', '.join(backend_names(kind))}")
    if not _load(kind, name):
        raise ValueError(f"the {kind} backend {name!r} cannot run here (its module {_MODULES[kind][name]} "
                         f"does not import: is triton installed?)")
    return _REGISTRY[(kind, name)]()
