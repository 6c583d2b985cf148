"""ModelConfig: what the engine needs from a checkpoint's config.json, read once."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float": torch.float32, "half": torch.float16}


class ModelLoadError(ValueError):
    """The checkpoint cannot be used; the message names the problem."""


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str
    hf_config: object  # transformers.PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int


def read_config_json(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model directory {model_dir!r} does not exist")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{model_dir!r} has no config.json: it is not a Hugging Face model directory")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def resolve_dtype(requested: str, hf_config, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and less exact
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = _DTYPES.get(checkpoint)
    return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16


def load_model_config(model_dir: str, dtype: str, device: torch.device,
                      max_model_len: int | None, supported: dict, overrides: dict | None = None) -> ModelConfig:
    """Read config.json, apply `overrides` (fields of config.json, `--hf-overrides`), check the
    architecture against `supported`, and derive the sizes."""
    raw = read_config_json(model_dir)
    architectures = raw.get("architectures") or []
    architecture = next((a for a in architectures if a in supported), None)
    if architecture is None:
        raise ModelLoadError(
            f"model architecture {architectures or '(none given)'} is not supported; "
            f"supported architectures: {', '.join(sorted(supported))}")
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    text_config = getattr(hf_config, "text_config", None) or hf_config
    for key, value in (overrides or {}).items():
        if not hasattr(text_config, key):
            raise ModelLoadError(f"hf_overrides: the {type(text_config).__name__} config has no field {key!r}")
        setattr(text_config, key, value)
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    model_max = getattr(text_config, "max_position_embeddings", None) or 2048
    if max_model_len is None:
        max_model_len = model_max
    elif max_model_len > model_max:
        raise ModelLoadError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"{model_max}")
    return ModelConfig(
        model_dir=model_dir, hf_config=text_config, architecture=architecture,
        dtype=resolve_dtype(dtype, text_config, device), max_model_len=max_model_len,
        vocab_size=text_config.vocab_size, hidden_size=text_config.hidden_size,
        num_layers=text_config.num_hidden_layers, num_attention_heads=heads,
        num_kv_heads=getattr(text_config, "num_key_value_heads", None) or heads, head_dim=head_dim)
