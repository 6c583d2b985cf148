"""Triton kernels of met's fast path, with PyTorch references in `reference.py`.

Every public kernel function dispatches: CUDA tensors (with triton installed)
take the Triton kernel, anything else the PyTorch reference. The `*_triton`
variants always run Triton; tests call those, on CPU through the Triton
interpreter (TRITON_INTERPRET=1, which must be set before the kernel modules
are imported: `@triton.jit` reads it at decoration time).

If triton is not importable, `triton`/`tl` below are stand-ins that let the
kernel modules import (their `@triton.jit` functions are never called) so the
reference fallbacks keep working.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken triton install
    HAS_TRITON = False

    class _Stub:
        """Just enough of `triton` / `triton.language` for decorators and annotations."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _Stub()  # type: ignore[assignment]


def interpret_mode() -> bool:
    """True when Triton runs kernels on CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """True when triton imports and there is something to run it on
    (a CUDA device, or the CPU interpreter via TRITON_INTERPRET=1)."""
    return HAS_TRITON and (interpret_mode() or torch.cuda.is_available())


def use_triton(t: torch.Tensor) -> bool:
    """Whether the dispatching kernel functions take the Triton path for `t`.
    CPU tensors always use the reference, even under TRITON_INTERPRET=1, so
    CPU engine tests never pay for the (slow) interpreter by accident."""
    return HAS_TRITON and t.is_cuda


__all__ = ["HAS_TRITON", "triton", "tl", "interpret_mode", "triton_available", "use_triton"]
