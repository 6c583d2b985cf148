"""DFlashConfig: a DFlash drafter checkpoint's config.json, read and checked against its target.

The public z-lab layout (github.com/z-lab/dflash): a Qwen3-style config.json with

    architectures        ["DFlashDraftModel"]
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, rms_norm_eps, attention_bias, rope_theta / rope_scaling / rope_parameters,
    vocab_size           the drafter's own decoder layers (it has no embedding and no LM head:
                         it uses the target's)
    dflash_config        {"mask_token_id": id, "target_layer_ids": [...], "block_size": n}
    block_size           (older checkpoints keep it here rather than in dflash_config)
    num_target_layers    only needed when target_layer_ids is absent: then the ids are spread
                         evenly over layers 1 .. num_target_layers - 3, as z-lab's code picks them

Target layer id i names the hidden state after the target's decoder layer i (the residual
stream, before the final norm). Everything that can be checked is checked here, before a weight
is read: an unknown architecture, a hidden size or vocabulary that differs from the target's, a
target layer id outside the target's layers, and drafter features not built (sliding-window
layers) are refused by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from metrale.config.errors import ModelLoadError

ARCHITECTURE = "DFlashDraftModel"


def evenly_spaced_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The target layers a drafter reads when its config does not list them: its layer count of
    ids spread over 1 .. num_target_layers - 3 (the middle layer for a one-layer drafter)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    model_dir: str
    hf_config: object  # a transformers Qwen3Config of the drafter's layers (rope parameters read from it)
    block_size: int  # tokens drafted in one pass: the last sampled token + block_size - 1 mask tokens
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool

    @property
    def max_drafts(self) -> int:
        """The most tokens one pass drafts: every block position but the first (the sampled token)."""
        return self.block_size - 1

    @classmethod
    def read(cls, model_dir: str) -> "DFlashConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise ModelLoadError(f"DFlash drafter directory {model_dir!r} does not exist (speculative_config "
                                 "'model')")
        if not os.path.isfile(path):
            raise ModelLoadError(f"DFlash drafter directory {model_dir!r} has no config.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"DFlash drafter config {path}: {e}") from None
        architectures = raw.get("architectures") or []
        if ARCHITECTURE not in architectures:
            raise ModelLoadError(f"{path}: architectures {architectures} is not a DFlash drafter; met builds "
                                 f"{ARCHITECTURE} (the z-lab DFlash layout)")
        dflash = raw.get("dflash_config") or {}
        block_size = dflash.get("block_size", raw.get("block_size"))
        mask_token_id = dflash.get("mask_token_id")
        for name, value in (("block_size", block_size), ("dflash_config.mask_token_id", mask_token_id)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelLoadError(f"{path}: {name} must be a non-negative integer, got {value!r}")
        if block_size < 2:
            raise ModelLoadError(f"{path}: block_size {block_size} drafts nothing (the block's first position is "
                                 "the sampled token)")
        num_layers = raw["num_hidden_layers"]
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if "num_target_layers" not in raw:
                raise ModelLoadError(f"{path}: dflash_config.target_layer_ids is missing, and so is "
                                     "num_target_layers to derive it from")
            layer_ids = evenly_spaced_layer_ids(raw["num_target_layers"], num_layers)
        layer_types = raw.get("layer_types") or []
        if raw.get("use_sliding_window") and any(t == "sliding_attention" for t in layer_types):
            raise ModelLoadError(f"{path}: sliding-window drafter layers are not built yet (docs/speculative.md)")
        import transformers

        fields = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dflash_config")}
        hf_config = transformers.Qwen3Config(**fields)
        num_heads = raw["num_attention_heads"]
        return cls(model_dir, hf_config, block_size, mask_token_id, tuple(int(i) for i in layer_ids), num_layers,
                   raw["hidden_size"], raw["vocab_size"], num_heads, raw.get("num_key_value_heads", num_heads),
                   raw.get("head_dim") or raw["hidden_size"] // num_heads, raw["intermediate_size"],
                   raw.get("rms_norm_eps", 1e-6), bool(raw.get("attention_bias", False)))

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int, architecture: str) -> None:
        """The drafter reads the target's hidden states and shares its embedding and LM head: the
        widths must agree, and every layer it reads must be one the target has (not the last: its
        output is the trunk's final hidden state, which the drafter's training did not see the same
        way in every transformers release)."""
        where = f"DFlash drafter {self.model_dir!r}"
        if self.hidden_size != hidden_size:
            raise ModelLoadError(f"{where}: hidden_size {self.hidden_size} does not match the target "
                                 f"{architecture}'s {hidden_size}")
        if self.vocab_size != vocab_size:
            raise ModelLoadError(f"{where}: vocab_size {self.vocab_size} does not match the target "
                                 f"{architecture}'s {vocab_size}")
        if not self.target_layer_ids:
            raise ModelLoadError(f"{where}: dflash_config.target_layer_ids is empty")
        outside = [i for i in self.target_layer_ids if not 0 <= i < num_layers - 1]
        if outside:
            raise ModelLoadError(f"{where}: target_layer_ids {outside} are not layers 0..{num_layers - 2} of the "
                                 f"target {architecture} ({num_layers} layers; the last layer's output is not read)")
        if not 0 <= self.mask_token_id < vocab_size:
            raise ModelLoadError(f"{where}: mask_token_id {self.mask_token_id} is outside the vocabulary "
                                 f"({vocab_size})")
