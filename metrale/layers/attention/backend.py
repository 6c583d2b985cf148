"""The attention backend interface and its registry.

A backend writes the new tokens' K and V into the paged cache and computes attention of the
flattened query rows over it (layout in executor/forward_context.py). The PyTorch backend is the
reference and runs anywhere; faster ones are tested against it. CUDA-graph capture needs nothing
extra from a backend as long as `forward` reads only tensors from the metadata (no host values
that change between replays); a backend that cannot do that says so with `supports_cuda_graphs`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from metrale.executor.forward_context import AttentionMetadata


class AttentionBackend(ABC):
    name: str = "abstract"
    supports_cuda_graphs: bool = False
    # The model may store K and V itself, in its RoPE kernel (Attention.rope_and_attend), with
    # the Triton KV write's layout and numerics, instead of calling write_kv.
    fused_prologue: bool = False

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim].
        An fp8 cache stores k / k_scale and v / v_scale, saturated at +-448."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; an fp8 cache
        is read back as value x scale."""


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: Triton on CUDA when it imports, else the PyTorch reference."""
    from metrale.layers.attention import torch_backend  # noqa: F401  (registers)

    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            try:
                from metrale.layers.attention import triton_backend  # noqa: F401
                name = "triton"
            except ImportError:
                pass
    elif name == "triton":
        from metrale.layers.attention import triton_backend  # noqa: F401
    if name not in _REGISTRY:
        raise ValueError(f"attention backend {name!r} is not available; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()
