"""ModelConfig: what the engine needs from a checkpoint's config.json, read once."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from metrale.config.errors import ModelLoadError
from metrale.config.quantization import Fp8Config, resolve_quantization

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float": torch.float32, "half": torch.float16}


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
    quantization: Fp8Config | None = None  # FP8 weights (config/quantization.py), else the model dtype


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


def remote_model_classes(raw: dict) -> dict[str, str]:
    """auto_map's model entries (AutoModel*: the checkpoint's own modeling code), as
    {auto class: "module.ClassName"}."""
    auto_map = raw.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        return {}
    found = {}
    for auto_class, reference in auto_map.items():
        if isinstance(reference, (list, tuple)):  # [slow, fast] pairs are tokenizers', not models'
            reference = next((r for r in reference if r), "")
        if auto_class.startswith("AutoModel") and isinstance(reference, str):
            found[auto_class] = reference.split("--")[-1]  # "repo--module.Class" names another repo
    return found


def check_no_remote_code(raw: dict, architecture: str, model_dir: str) -> None:
    """met never runs a checkpoint's code. A checkpoint whose auto_map names modeling code for a
    class other than the architecture met implements is refused: loading it as that architecture
    would run a different model. Code for the very architecture met implements (DeepSeek-V3 and
    MiniMax-M2 ship such copies) is ignored, and met runs its own."""
    remote = remote_model_classes(raw)
    foreign = {k: v for k, v in remote.items() if v.rsplit(".", 1)[-1] != architecture}
    if foreign:
        listed = ", ".join(f"{k} -> {v}" for k, v in sorted(foreign.items()))
        raise ModelLoadError(
            f"{model_dir!r} ships its own modeling code (config.json auto_map: {listed}). met never runs code "
            f"from a checkpoint, and its own {architecture} may not be the model that code defines, so it "
            f"refuses the checkpoint rather than generate wrong output. Use a checkpoint of an architecture "
            f"met implements without custom code.")
    if remote:
        logger.info("config.json's auto_map names the checkpoint's own code for %s; met runs its own "
                    "implementation and none of that code", architecture)


def read_hf_config(model_dir: str, raw: dict):
    """transformers' config object, never from the checkpoint's code."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        import transformers

        path = os.path.join(model_dir, "config.json")
        known = raw.get("model_type") in transformers.CONFIG_MAPPING
        if known:
            raise ModelLoadError(f"transformers {transformers.__version__} cannot read {path}: {e}") from None
        # transformers' own message advises trust_remote_code=True, which met does not have.
        raise ModelLoadError(
            f"transformers {transformers.__version__} does not know model_type {raw.get('model_type')!r} "
            f"({path}). met reads configs with transformers and never runs a checkpoint's own code: upgrade "
            f"transformers if the family is newer than it, or use a supported checkpoint.") from None


# Fields met reads that transformers' config class of a family may not define, which
# --hf-overrides may still set: the MTP layer count of met's dense `mtp.*` layout (models/qwen_mtp.py).
MET_ONLY_FIELDS = ("num_nextn_predict_layers",)


def load_model_config(model_dir: str, dtype: str, device: torch.device,
                      max_model_len: int | None, supported: dict, overrides: dict | None = None,
                      quantization: str | None = None, activation_quantization: str = "dynamic") -> ModelConfig:
    """Read config.json, apply `overrides` (fields of config.json, `--hf-overrides`), check the
    architecture against `supported` and the quantized format (config.json's quantization_config,
    `--quantization`), and derive the sizes."""
    raw = read_config_json(model_dir)
    architectures = raw.get("architectures") or []
    architecture = next((a for a in architectures if a in supported), None)
    if architecture is None:
        raise ModelLoadError(
            f"model architecture {architectures or '(none given)'} is not supported; "
            f"supported architectures: {', '.join(sorted(supported))}")
    check_no_remote_code(raw, architecture, model_dir)
    quantized = resolve_quantization(raw.get("quantization_config"), quantization, activation_quantization, model_dir)
    hf_config = read_hf_config(model_dir, raw)
    text_config = getattr(hf_config, "text_config", None) or hf_config
    for key, value in (overrides or {}).items():
        if not hasattr(text_config, key) and key not in MET_ONLY_FIELDS:
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
        num_kv_heads=getattr(text_config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        quantization=quantized)
