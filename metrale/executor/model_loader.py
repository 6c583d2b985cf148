"""Build a model on its device and fill its weights (checkpoint or dummy)."""

from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

from metrale.config.model_config import ModelConfig
from metrale.loader.kv_scales import take_kv_scales
from metrale.loader.safetensors_loader import count_tensors, iterate_tensors
from metrale.layers.deferred_weights import deferred_weights
from metrale.loader.weights import init_dummy_weights, load_weights
from metrale.models.registry import get_model_class
from metrale.layers.quantization.apply import quantize_model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def construct_model(config: ModelConfig, device: torch.device) -> torch.nn.Module:
    """The model with uninitialised weights on `device` (the meta device: sizes only).
    Parameters are created where they live, in their dtype: no float32 copy on the host first;
    projection weights once their names are known, FP8 where the model is quantized."""
    model_class = get_model_class(config.architecture)
    with torch.device(device), _default_dtype(config.dtype), deferred_weights():
        model = model_class(config)
    quantize_model(model, config.quantization, device, config.dtype)
    return model


def build_model(config: ModelConfig, device: torch.device, load_format: str = "auto", seed: int = 0,
                show_progress: bool = False) -> torch.nn.Module:
    model = construct_model(config, device)
    if load_format == "dummy":
        init_dummy_weights(model, config.hf_config, seed)
    else:
        total = count_tensors(config.model_dir) if show_progress else None
        with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
            load_weights(model, take_kv_scales(model, iterate_tensors(config.model_dir)), progress=bar)
    return model.eval()
