"""Build a model on its device and fill its weights (checkpoint or dummy)."""

from __future__ import annotations

import contextlib
import logging

import torch
from tqdm.auto import tqdm

from metrale.config.model_config import ModelConfig
from metrale.loader.kv_scales import take_kv_scales
from metrale.loader.safetensors_loader import count_tensors, iterate_tensors, sha256_of_tensors, tensor_locations
from metrale.layers.deferred_weights import deferred_weights
from metrale.loader.weights import init_dummy_weights, load_weights
from metrale.models.mtp import checkpoint_tensor_names, mtp_prefixes
from metrale.models.registry import get_model_class
from metrale.layers.quantization.apply import quantize_model

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def construct_model(config: ModelConfig, device: torch.device, load_format: str = "auto") -> torch.nn.Module:
    """The model with uninitialised weights on `device` (the meta device: sizes only).
    Parameters are created where they live, in their dtype: no float32 copy on the host first;
    projection weights once their names are known, FP8 where the model is quantized. Dummy
    weights never include multi-token-prediction layers (models/mtp.py)."""
    model_class = get_model_class(config.architecture)
    # Multi-token-prediction layers are built where the checkpoint holds them: its names, from
    # the headers (models/mtp.py); dummy weights never include them.
    # A family with MTP layers says how many its config declares (`declared_mtp_layers`).
    declared = getattr(model_class, "declared_mtp_layers", None)
    names = tensor_locations(config.model_dir) if load_format != "dummy" and declared and declared(config) else ()
    with torch.device(device), _default_dtype(config.dtype), deferred_weights(), checkpoint_tensor_names(names):
        model = model_class(config)
    quantize_model(model, config.quantization, device, config.dtype)
    return model


def build_model(config: ModelConfig, device: torch.device, load_format: str = "auto", seed: int = 0,
                show_progress: bool = False) -> torch.nn.Module:
    model = construct_model(config, device, load_format)
    if load_format == "dummy":
        init_dummy_weights(model, config.hf_config, seed)
    else:
        total = count_tensors(config.model_dir) if show_progress else None
        with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
            load_weights(model, take_kv_scales(model, iterate_tensors(config.model_dir)), progress=bar)
        record_mtp_hash(model, config)
    return model.eval()


def record_mtp_hash(model: torch.nn.Module, config: ModelConfig) -> None:
    """After loading: the multi-token-prediction tensors' sha256 as stored (models/mtp.py) on the
    model as `mtp_sha256`, logged."""
    prefixes = mtp_prefixes(model)
    if not prefixes:
        return
    model.mtp_tensor_count, model.mtp_sha256 = sha256_of_tensors(config.model_dir, prefixes)
    params = sum(p.numel() for p in model.mtp.parameters())
    logger.info("MTP: %d layer(s), %d tensors, %.1fM parameters, sha256 %s (run by the MTP drafter of "
                "speculative decoding only)", len(model.mtp), model.mtp_tensor_count, params / 1e6, model.mtp_sha256)
