"""Put checkpoint tensors into a model's parameters, or random ones (`--load-format dummy`).

Checkpoint names map onto ours in three ways: a model's `checkpoint_renames` (substring
replacements, e.g. MiniMax's `block_sparse_moe` -> `mlp`); its `stacked_params` (q/k/v into
qkv_proj, gate/up into gate_up_proj); and MoE expert tensors (per expert or stacked by
transformers) into a FusedMoE layer's `w13` / `w2`. Each parameter's `weight_loader` takes this
rank's slice. A piece the model needs but the checkpoint lacks is an error that names it, down
to the shard and the expert. FP8 weights and their `weight_scale_inv` load as pairs
(loader/fp8_pairs.py). Once every tensor is in, each module that defines
`process_weights_after_loading()` re-lays out or derives what it computes from (a post-load hook:
Gated DeltaNet's float32 decay rates, MLA's absorbed projections, FP8 scale layouts).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable

import torch
from torch import nn

from metrale.config.model_config import ModelLoadError
from metrale.layers.moe.layer import FusedMoE
from metrale.layers.moe.loading import expert_pieces, expert_target
from metrale.loader.fp8_pairs import SCALE_SUFFIX, Fp8Pairs

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _default_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(loaded)


class _Mapping:
    """Where a model's parameters come from, and which pieces a complete checkpoint supplies."""

    def __init__(self, model: nn.Module, quantize_unquantized: bool = False):
        self.params = dict(model.named_parameters())
        # FusedMoE parameters -> (layer, "w13" or "w2"): the weights and their FP8 scales.
        self.moe = {f"{prefix}.{p}{suffix}": (layer, p) for prefix, layer in model.named_modules()
                    if isinstance(layer, FusedMoE) for p in ("w13", "w2") for suffix in ("", "_weight" + SCALE_SUFFIX)
                    if f"{prefix}.{p}{suffix}" in self.params}
        self.stacked = getattr(model, "stacked_params", [])
        self.renames = getattr(model, "checkpoint_renames", ())
        self.ignored_prefixes = getattr(model, "ignored_checkpoint_prefixes", ())
        self.skip_lm_head = getattr(model, "tied_embeddings", False)
        config = getattr(model, "config", None)
        self.fp8 = Fp8Pairs(self, getattr(config, "quantization", None), quantize_unquantized)
        # Checkpoint tensors no parameter takes (and the model does not declare ignorable).
        self.unconsumed: list[str] = []

    def expected_pieces(self) -> set:
        shards_of: dict[str, list] = {}
        for ours, _, shard in self.stacked:
            shards_of.setdefault(ours, []).append(shard)
        expected = set()
        for name in self.params:
            if name in self.moe:
                layer, kind = self.moe[name]
                expected |= expert_pieces(name, layer, kind, None)
                continue
            module_name = name.rsplit(".", 2)[-2] if "." in name else name
            expected |= {(name, shard) for shard in shards_of.get(module_name, [None])}
        return expected

    def load(self, checkpoint_name: str, tensor: torch.Tensor) -> set:
        """Copy one checkpoint tensor in; returns the pieces it supplied (an FP8 weight or scale
        may wait for its partner and supply them later)."""
        name = checkpoint_name
        for theirs, ours in self.renames:
            name = name.replace(theirs, ours)
        if (name.endswith(_IGNORED_SUFFIXES) or name.startswith(self.ignored_prefixes)
                or (self.skip_lm_head and name.startswith("lm_head."))):
            return set()
        if name.endswith(SCALE_SUFFIX):
            return self.fp8.take_scale(checkpoint_name, name, tensor)
        target = self.resolve(name)
        if target is None:
            self.unconsumed.append(checkpoint_name)
            return set()
        return self.fp8.take_weight(checkpoint_name, name, target, tensor)

    def resolve(self, name: str) -> tuple[str, object] | None:
        """Our parameter and shard (an expert's: (shard, expert)) of a checkpoint name, renamed."""
        target = expert_target(name)
        if target is not None and target[0] in self.moe:
            param_name, shard, expert = target
            return param_name, shard if expert is None else (shard, expert)
        for ours, theirs, shard_id in self.stacked:
            if f".{theirs}." in name:
                name = name.replace(f".{theirs}.", f".{ours}.")
                return (name, shard_id) if name in self.params else None
        return (name, None) if name in self.params else None

    def put(self, param_name: str, shard, tensor: torch.Tensor) -> set:
        """Copy `tensor` into our parameter's piece; returns the pieces supplied."""
        param = self.params[param_name]
        if param_name in self.moe:
            layer, _ = self.moe[param_name]
            shard_id, expert = shard if isinstance(shard, tuple) else (shard, None)
            layer.weight_loader(param, tensor, shard_id, expert)
            return expert_pieces(param_name, layer, shard_id, expert)
        loader = getattr(param, "weight_loader", _default_loader)
        loader(param, tensor) if shard is None else loader(param, tensor, shard)
        return {(param_name, shard)}


def _describe(name: str, shard) -> str:
    if isinstance(shard, tuple):
        return f"{name}[{shard[0]}, expert {shard[1]}]"
    return f"{name}[{shard}]" if shard is not None else name


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], progress=None,
                 quantize_unquantized: bool = False) -> None:
    """`quantize_unquantized`: FP8 layers quantize high-precision tensors as they arrive (dummy
    weights of a quantized config; `--quantization fp8` does so whatever this says)."""
    mapping = _Mapping(model, quantize_unquantized)
    loaded: set = set()
    for name, tensor in weights:
        if progress is not None:
            progress.update(1)
        try:
            loaded |= mapping.load(name, tensor)
        except ValueError as e:
            raise ModelLoadError(f"checkpoint tensor {name}: {e}") from None
    if mapping.unconsumed:
        names = mapping.unconsumed
        raise ModelLoadError(
            f"the checkpoint holds {len(names)} tensor(s) that no parameter of {type(model).__name__} takes, e.g. "
            f"{', '.join(names[:5])}: it is not the model met would build from its config (another variant, "
            f"extra modules, or a quantized copy), and loading it anyway would run a different model")
    mapping.fp8.check_complete()
    missing = mapping.expected_pieces() - loaded
    if missing:
        names = sorted(_describe(n, s) for n, s in missing)
        raise ModelLoadError(f"the checkpoint is missing {len(names)} tensor(s) the model needs, e.g. "
                             f"{', '.join(names[:5])}")
    run_post_load_hooks(model)


def run_post_load_hooks(model: nn.Module) -> None:
    """Every module's `process_weights_after_loading()`, children before their parents."""
    with torch.no_grad():
        for module in reversed(list(model.modules())):
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()


def dummy_checkpoint(hf_config, device: torch.device, dtype: torch.dtype, seed: int = 0, reference_of=None,
                     extra_shapes=None):
    """(name, tensor) pairs of a random checkpoint of this config: transformers' parameter names
    and full shapes (read from a model built on the meta device), each tensor drawn from its own
    generator seeded by the seed and its name. Loaded like a real checkpoint, every rank takes its
    shard of the same full tensors, so a split model computes what one GPU computes. Norm
    weights are one; values are uniform in [-0.02, 0.02]. `reference_of(hf_config)`: the
    checkpoint's names and shapes ({name: tensor}, built under the meta device) where
    AutoModelForCausalLM has no model for the config (a model class's `dummy_reference`, e.g.
    GLM-5.3's). `extra_shapes(reference) -> {name: shape}`: tensors the reference lacks (the
    model's MTP layers), drawn the same way after it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = (reference_of(hf_config) if reference_of is not None
                  else AutoModelForCausalLM.from_config(hf_config).state_dict())
    shapes = {name: tuple(shaped.shape) for name, shaped in shapes.items()}
    if extra_shapes is not None:
        shapes.update(extra_shapes(shapes))
    for name, shape in shapes.items():
        module = name.rsplit(".", 1)[0]
        if module.endswith("norm") or ".pre_fc_norm_" in module:  # `mtp.pre_fc_norm_hidden` too
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        tensor = torch.empty(shape, dtype=dtype, device=device)
        yield name, tensor.uniform_(-0.02, 0.02, generator=generator)


def dummy_mtp_shapes(model: nn.Module, reference_shapes: dict) -> dict:
    """The checkpoint names and shapes of the MTP layers `model.mtp` holds (each layer's
    `dummy_checkpoint_shapes`, models/mtp.py and models/qwen_mtp.py), shaped on the reference's."""
    shapes = {}
    for index, layer in enumerate(getattr(model, "mtp", None) or ()):
        shapes.update(layer.dummy_checkpoint_shapes(index, reference_shapes))
    return shapes


def init_dummy_weights(model: nn.Module, hf_config, seed: int = 0) -> dict:
    """Random weights of the right shapes and dtypes, drawn on the model's own device from
    `dummy_checkpoint`, the MTP layers' included. For benchmarks: they cost the same time as real
    weights. Returns the MTP tensors' {name: shape} ({} without MTP layers)."""
    param = model.model.embed_tokens.weight if hasattr(model, "model") else next(model.parameters())
    mtp_shapes = {}

    def extra(reference_shapes):
        mtp_shapes.update(dummy_mtp_shapes(model, reference_shapes))
        return mtp_shapes

    weights = dummy_checkpoint(hf_config, param.device, param.dtype, seed, getattr(model, "dummy_reference", None),
                               extra_shapes=extra)
    load_weights(model, weights, quantize_unquantized=True)
    return mtp_shapes
