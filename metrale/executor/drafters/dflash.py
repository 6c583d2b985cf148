"""The DFlash drafter in the runner: a separate drafter checkpoint (models/dflash.py) that reads
the target's hidden states after the layers its config names and drafts k tokens in one pass.

Every step that computes tokens (prefill chunks, decodes, verify steps), `propose`:

1. writes the drafter's context K/V of each of the step's rows, from the target's hidden states
   after `target_layer_ids` (`DraftInputs.layer_hidden`), at the rows' positions and KV slots
   (the target's slot mapping: the drafter's cache shares its block tables). Rows past a request's
   last accepted one (rejected drafts) are written too and masked out of the pass below; the
   next step recomputes and overwrites them.
2. for each sampled request, runs one block: its sampled token, then block_size - 1 mask tokens,
   at the positions from the one after its last accepted row; the block sees the context before
   it and itself, non-causally. Drafts 1..k are the argmax of the target's LM head at block rows
   1..k (ids at or past the tokenizer's size excluded). The block's own K/V are never stored, so
   no KV slot past the step's last position is written (`lookahead_tokens` = 0).

Nothing here reads a device value on the host: the block's context length stays on the device
(the pass gathers each request's context up to the step's sequence length and masks the rest).

Drafts are point masses (the rejection sampler's n-gram rule), whatever the request's
temperature: lossless either way, the verifier decides.

sha256: over every tensor of the drafter checkpoint as stored, in name order (each its name,
then its bytes), logged at startup and kept as `.sha256` (the cost model's table is keyed on it).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from metrale.config.dflash_config import DFlashConfig
from metrale.config.errors import ModelLoadError
from metrale.config.model_config import ModelConfig
from metrale.executor.drafters.base import DraftInputs, DraftOutput, RunnerDrafter
from metrale.executor.memory_plan import parameter_bytes
from metrale.loader.safetensors_loader import iterate_tensors, sha256_of_tensors
from metrale.loader.weights import load_weights
from metrale.models.common import DecoderModel
from metrale.models.dflash import DFlashDraftModel, DraftBlocks

logger = logging.getLogger(__name__)


def checked_config(drafter_dir: str, target: ModelConfig, k: int) -> DFlashConfig:
    """The drafter's config, refused by name where it does not fit the target or k."""
    config = DFlashConfig.read(drafter_dir)
    config.check_target(target.hidden_size, target.vocab_size, target.num_layers, target.architecture)
    if k > config.max_drafts:
        raise ModelLoadError(f"num_speculative_tokens {k} is above what the DFlash drafter {drafter_dir!r} drafts in "
                             f"one pass: {config.max_drafts} (its block_size {config.block_size} - 1)")
    return config


def check_trunk(target_model: nn.Module) -> None:
    """The drafter reads the target's layer outputs, which the shared trunk (models/common.py's
    DecoderModel.output_layers) keeps; a family with a trunk of its own is refused by name."""
    if not isinstance(getattr(target_model, "model", None), DecoderModel):
        architecture = getattr(getattr(target_model, "config", None), "architecture", type(target_model).__name__)
        raise ModelLoadError(f"DFlash drafting reads the target's hidden states after chosen layers, and "
                             f"{architecture}'s trunk does not expose them yet")


def build_dflash_model(config: DFlashConfig, target: ModelConfig, device: torch.device) -> DFlashDraftModel:
    """The drafter module on `device` (meta: sizes only) in the target's dtype, weights not loaded.
    Its layers are numbered after the target's; RoPE covers a block past the context length."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(device):
            return DFlashDraftModel(config, target.num_layers, target.max_model_len + config.block_size)
    finally:
        torch.set_default_dtype(previous)


class DFlashDrafter(RunnerDrafter):
    method = "dflash"

    def __init__(self, target_model: nn.Module, drafter_dir: str, k: int):
        target: ModelConfig = target_model.config
        check_trunk(target_model)
        config = checked_config(drafter_dir, target, k)
        device = target_model.model.embed_tokens.weight.device
        self.model = build_dflash_model(config, target, device)
        load_weights(self.model, iterate_tensors(drafter_dir))
        self.model.eval()
        self.config, self.k = config, k
        self.hidden_layers = config.target_layer_ids
        self.embed_tokens, self.lm_head = target_model.model.embed_tokens, target_model.lm_head
        self.tensor_count, self.sha256 = sha256_of_tensors(drafter_dir, ("",))
        params = sum(p.numel() for p in self.model.parameters())
        logger.info("DFlash drafter %s: %d layer(s) reading target layers %s, block %d, %d tensors, %.1fM parameters, "
                    "sha256 %s", drafter_dir, config.num_layers, list(config.target_layer_ids), config.block_size,
                    self.tensor_count, params / 1e6, self.sha256)

    def cached_layers(self) -> list:
        return [layer.self_attn for layer in self.model.layers]

    def propose(self, inputs: DraftInputs) -> DraftOutput:
        layout = inputs.layout
        features = torch.cat([inputs.layer_hidden[i] for i in self.hidden_layers], dim=-1)
        self.model.write_context(features, layout.positions, layout.slot_mapping)
        num_sampled, device = len(inputs.request_ids), features.device
        if not num_sampled:
            return DraftOutput(torch.full((0, self.k), -1, dtype=torch.int64, device=device))
        n = self.config.block_size
        starts = layout.positions[inputs.last_rows] + 1  # each block's first position = its context length
        positions = (starts[:, None] + torch.arange(n, device=device)).reshape(-1)
        tables = layout.block_tables[inputs.seq_index]
        bounds = [layout.seq_len_bounds[s] for s in inputs.seq_index_cpu]  # the step's rows, accepted or not
        blocks = DraftBlocks(positions, tables, starts, bounds, n)
        drafts = self.model.draft(inputs.sampled_tokens, blocks, self.embed_tokens, self.lm_head, self.k,
                                  inputs.sampled_vocab_size)
        return DraftOutput(drafts)


def dflash_meta_model(target_meta_model: nn.Module, drafter_dir: str, k: int) -> DFlashDraftModel:
    """The drafter on the meta device (its config checked, no weights read): the memory plan
    counts its caches and its weights before anything loads."""
    target: ModelConfig = target_meta_model.config
    check_trunk(target_meta_model)
    return build_dflash_model(checked_config(drafter_dir, target, k), target, torch.device("meta"))


def dflash_cached_layers(target_meta_model: nn.Module, drafter_dir: str, k: int) -> list:
    return [layer.self_attn for layer in dflash_meta_model(target_meta_model, drafter_dir, k).layers]


def dflash_weight_bytes(target_meta_model: nn.Module, drafter_dir: str, k: int) -> int:
    return parameter_bytes(dflash_meta_model(target_meta_model, drafter_dir, k))
