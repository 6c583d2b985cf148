"""Where the model comes from: the device, the model directory (a checkpoint, the built-in demo,
or a shipped config for dummy weights), its config and its tokenizer."""

from __future__ import annotations

import os

import torch

from metrale.config.demo_model import demo_model_dir
from metrale.config.engine_args import EngineArgs
from metrale.config.errors import OptionError
from metrale.kernels import interpret_mode
from metrale.config.model_config import ModelConfig, ModelLoadError, load_model_config
from metrale.models.registry import supported_architectures

SHIPPED_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "model_configs")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but PyTorch sees no CUDA device")
    return torch.device(name)


def resolve_model_dir(model: str | None, load_format: str) -> str:
    """A directory; `demo` (or nothing) for the built-in demo model; or, with dummy weights, the
    name of a real model whose config.json ships with met (metrale/model_configs/)."""
    if model in (None, "demo"):
        return demo_model_dir()
    if not os.path.isdir(model) and load_format == "dummy":
        shipped = os.path.join(SHIPPED_CONFIGS, os.path.basename(model.rstrip("/")))
        if os.path.isdir(shipped):
            return shipped
    return model


def read_model_config(args: EngineArgs, device: torch.device) -> ModelConfig:
    """The model directory `args` names and its config, with `--hf-overrides` applied."""
    model_dir = resolve_model_dir(args.model, args.load_format)
    return load_model_config(model_dir, args.dtype, device, args.max_model_len, supported_architectures(),
                             args.config_overrides, args.quantization, args.activation_quantization)


def load_tokenizer(args: EngineArgs, model_dir: str):
    if args.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(args.tokenizer or model_dir, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {args.tokenizer or model_dir!r} ({e}); pass "
                             "--tokenizer DIR, or --skip-tokenizer-init to send token ids only") from None


# hidden_act values the models' MLPs implement (layers/mlp.py: SiLU-gated).
SUPPORTED_ACTIVATIONS = ("silu", "swish")


def check_activation(config: ModelConfig) -> None:
    """Refuse a checkpoint whose MLP activation met does not implement, rather than run SiLU."""
    hf = config.hf_config
    act = getattr(hf, "hidden_act", None) or getattr(hf, "hidden_activation", None)
    if act is not None and act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"{config.architecture} with hidden_act {act!r} is not supported; met's MLPs "
                             f"implement {', '.join(SUPPORTED_ACTIVATIONS)}")


def sampled_vocab_size(config: ModelConfig, tokenizer) -> int | None:
    """The tokenizer's size where the checkpoint pads its vocabulary past it (the padded rows
    are never sampled), else None."""
    if tokenizer is None:
        return None
    size = len(tokenizer)
    return size if size < config.vocab_size else None


def vocabulary_note(config: ModelConfig, tokenizer) -> str:
    capped = sampled_vocab_size(config, tokenizer)
    if tokenizer is None:
        return f"vocabulary {config.vocab_size:,}, no tokenizer"
    if capped is None:
        return f"vocabulary {config.vocab_size:,}"
    return f"vocabulary {config.vocab_size:,} rows, sampling capped to the tokenizer's {capped:,}"


def resolve_forward(args: EngineArgs, device: torch.device) -> str:
    """--forward, resolved for this device: graphs, eager or reference."""
    forward = args.forward
    if forward == "auto":
        forward = ("eager" if args.enforce_eager else "graphs") if device.type == "cuda" else "reference"
    if forward == "graphs" and device.type != "cuda":
        raise OptionError("--forward graphs captures CUDA graphs, which need a CUDA device; on the CPU the forward "
                          "is the PyTorch reference (--forward reference)")
    if forward == "eager" and device.type != "cuda" and not interpret_mode():
        raise OptionError("--forward eager runs the Triton kernels, which need a CUDA device (or, for checks "
                          "only, TRITON_INTERPRET=1: their interpreter); on the CPU the forward is the PyTorch "
                          "reference (--forward reference)")
    if forward == "graphs" and args.enforce_eager:
        raise OptionError("--forward graphs captures CUDA graphs, which --enforce-eager forbids; give one")
    if args.forward == "reference" and args.attention_backend == "triton":
        raise OptionError("--forward reference runs the PyTorch backends everywhere; drop --attention-backend triton")
    return forward
