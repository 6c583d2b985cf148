"""Build a model on its device and fill its weights (checkpoint or dummy)."""

from __future__ import annotations

import contextlib
import hashlib
import json
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
    weights hold every multi-token-prediction layer the config declares (models/mtp.py)."""
    model_class = get_model_class(config.architecture)
    # Multi-token-prediction layers are built where the checkpoint holds them: its names, from
    # the headers (models/mtp.py); dummy weights draw every declared one.
    # A family with MTP layers says how many its config declares (`declared_mtp_layers`).
    declared = getattr(model_class, "declared_mtp_layers", None)
    dummy = load_format == "dummy"
    names = tensor_locations(config.model_dir) if not dummy and declared and declared(config) else ()
    with (torch.device(device), _default_dtype(config.dtype), deferred_weights(),
          checkpoint_tensor_names(names, dummy=dummy)):
        model = model_class(config)
    quantize_model(model, config.quantization, device, config.dtype)
    return model


def build_model(config: ModelConfig, device: torch.device, load_format: str = "auto", seed: int = 0,
                show_progress: bool = False) -> torch.nn.Module:
    model = construct_model(config, device, load_format)
    if load_format == "dummy":
        record_dummy_mtp_hash(model, init_dummy_weights(model, config.hf_config, seed), seed)
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


def record_dummy_mtp_hash(model: torch.nn.Module, mtp_shapes: dict, seed: int) -> None:
    """Dummy MTP layers (`--load-format dummy`): their values are a function of the seed and the
    tensors' names and shapes, so `mtp_sha256` is the sha256 of those (canonical JSON), logged.
    It keys a spec-cost table measured on them, and matches no real checkpoint's."""
    if not mtp_shapes:
        return
    described = {"load_format": "dummy", "seed": seed, "tensors": {n: list(s) for n, s in sorted(mtp_shapes.items())}}
    model.mtp_sha256 = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    model.mtp_tensor_count = len(mtp_shapes)
    params = sum(p.numel() for p in model.mtp.parameters())
    logger.info("MTP: %d dummy layer(s), %d tensors, %.1fM parameters, random weights (sha256 %s of the seed and "
                "their names and shapes)", len(model.mtp), len(mtp_shapes), params / 1e6, model.mtp_sha256)
