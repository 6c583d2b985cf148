"""Projection weights allocated after the model is built, once each layer's name is known.

A quantized model decides a projection's format by its name (`modules_to_not_convert`), which a
layer does not know while it is constructed. Inside `deferred_weights()`, linear and expert
layers create their weights on the meta device (no memory); `layers.quantization.apply` then walks
the named modules and gives each its real weight, FP8 or not, on the model's device. Outside
the context (every unquantized model) weights are allocated where the layer is built, as usual.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

_deferring: contextvars.ContextVar[bool] = contextvars.ContextVar("met_deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights():
    token = _deferring.set(True)
    try:
        yield
    finally:
        _deferring.reset(token)


def new_weight(*shape: int) -> nn.Parameter:
    """A projection weight of the default dtype: on the meta device while deferring."""
    device = torch.device("meta") if _deferring.get() else None
    return nn.Parameter(torch.empty(*shape, device=device), requires_grad=False)


def is_deferred(param: torch.Tensor) -> bool:
    return param.is_meta
