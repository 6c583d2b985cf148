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

import contextlib
import contextvars
import functools
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


# Programmatic dependent launch (Hopper and newer): a kernel launched with it may start while the
# kernel before it drains. Every program of it waits (griddepcontrol.wait) before it reads
# anything an earlier kernel writes, and before it could return, so it never reads unfinished
# results nor completes before its predecessor; only weights are read before the wait. Set
# once per process at engine startup; CUDA graphs keep the edges they were captured with.
_PROGRAMMATIC_LAUNCH = False


def set_programmatic_launch(enabled: bool) -> None:
    global _PROGRAMMATIC_LAUNCH
    _PROGRAMMATIC_LAUNCH = bool(enabled) and not interpret_mode()


def programmatic_launch_supported(device: torch.device) -> bool:
    return device.type == "cuda" and HAS_TRITON and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args() -> dict:
    """Launch arguments of a kernel that takes a `PDL: tl.constexpr` and calls `pdl_wait(PDL)`
    in every program before reading any activation (see above)."""
    return {"PDL": True, "launch_pdl": True} if _PROGRAMMATIC_LAUNCH else {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    # Every program waits, unconditionally, before its first read of an activation: a program
    # that returned before waiting could let its kernel complete before the one it depends on.
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    # Lets the next kernel's programs start (and wait for this kernel) once every program of
    # this one has passed here: a kernel followed by one that prefetches what no kernel
    # writes (the GEMV's weights) calls it right after pdl_wait.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index) -> int:
    if interpret_mode() or not torch.cuda.is_available():
        return 4  # the CPU interpreter stands in for a small GPU, so split and path choices get tested
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The streaming multiprocessors that launch heuristics fill (cached per device)."""
    return _sm_count(device.index if device.type == "cuda" else None)


# Which path the dispatchers take, when a caller decides it for a stretch of work: "reference"
# while a `--forward reference` model runs (ModelRunner), "kernels" while the kernel audit runs
# the Triton path on CPU tensors through the interpreter (`met serve --check-kernels` on a CPU).
_forced_path: contextvars.ContextVar[str | None] = contextvars.ContextVar("met_kernel_path", default=None)


@contextlib.contextmanager
def kernel_path(path: str | None):
    """Within it (this thread or task), `use_triton` answers for `path`: "reference" (never),
    "kernels" (always, where triton imports), or None (the default rule)."""
    assert path in (None, "reference", "kernels"), path
    token = _forced_path.set(path)
    try:
        yield
    finally:
        _forced_path.reset(token)


def use_triton(t: torch.Tensor) -> bool:
    """Whether the dispatching kernel functions take the Triton path for `t`.
    CPU tensors use the reference, even under TRITON_INTERPRET=1, so CPU engine tests never pay
    for the (slow) interpreter by accident; `kernel_path` overrides the rule for a stretch of work."""
    forced = _forced_path.get()
    if forced is not None:
        return HAS_TRITON and forced == "kernels"
    return HAS_TRITON and t.is_cuda


__all__ = ["HAS_TRITON", "triton", "tl", "interpret_mode", "triton_available", "use_triton", "kernel_path", "pdl_args", "pdl_wait",
           "pdl_launch_dependents", "set_programmatic_launch", "programmatic_launch_supported", "num_sms"]
