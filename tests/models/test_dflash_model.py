"""The DFlash drafter module alone: its drafts for given target hidden states equal the plain-torch
reference written from z-lab's description (tests/dflash_checkpoints.py), with the context written
into its paged cache in chunks through a scattered block table; and its config's refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

from checkpoints import load_reference
from dflash_checkpoints import (BLOCK_SIZE, TARGET_LAYERS, make_dflash_drafter, make_dflash_target,
                                reference_drafts, target_features)
from metrale.config.dflash_config import DFlashConfig, evenly_spaced_layer_ids
from metrale.config.errors import ModelLoadError
from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from metrale.loader.safetensors_loader import iterate_tensors
from metrale.loader.weights import load_weights
from metrale.models.dflash import DFlashDraftModel, DraftBlocks

CACHE_BLOCK = 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_model")
    target = make_dflash_target(str(root / "target"), "qwen3")
    return target, make_dflash_drafter(str(root / "drafter"), target)


def build(drafter_dir: str) -> DFlashDraftModel:
    config = DFlashConfig.read(drafter_dir)
    model = DFlashDraftModel(config, TARGET_LAYERS, 512)
    load_weights(model, iterate_tensors(drafter_dir))
    return model.eval()


def target_head(reference):
    embed = VocabParallelEmbedding(*reference.get_input_embeddings().weight.shape)
    head = ParallelLMHead(*reference.get_output_embeddings().weight.shape)
    embed.weight.data.copy_(reference.get_input_embeddings().weight)
    head.weight.data.copy_(reference.get_output_embeddings().weight)
    return embed, head


@torch.no_grad()
def test_drafts_equal_the_reference(dirs):
    target_dir, drafter_dir = dirs
    reference = load_reference(target_dir)
    model, (embed, head) = build(drafter_dir), target_head(reference)
    layer = model.layers[0].self_attn
    for attn in (l.self_attn for l in model.layers):
        attn.bind_caches((torch.zeros(2, 12, CACHE_BLOCK, attn.num_kv_heads, attn.head_dim),))
    table = torch.tensor([7, 2, 9, 0, 5, 11], dtype=torch.int32)  # scattered blocks
    prompts = [[5, 17, 200, 33, 5, 17, 200, 33, 9, 41, 120], [8, 99]]
    for tokens in prompts:
        features = target_features(reference, tokens)
        n = len(tokens) - 1  # context: all but the last token, which opens the block
        positions = torch.arange(n)
        slots = table[positions // CACHE_BLOCK].long() * CACHE_BLOCK + positions % CACHE_BLOCK
        for chunk in (slice(0, n // 2), slice(n // 2, n)):  # written in two steps, as chunked prefill does
            model.write_context(features[chunk], positions[chunk], slots[chunk])
        # Rows past the context (a verify step's rejected drafts) hold other K/V: masked out.
        stale = torch.arange(n, n + 3)
        model.write_context(torch.randn(3, features.shape[1]), stale,
                            table[stale // CACHE_BLOCK].long() * CACHE_BLOCK + stale % CACHE_BLOCK)
        blocks = DraftBlocks(torch.arange(n, n + BLOCK_SIZE), table[None], torch.tensor([n]), [n + 3], BLOCK_SIZE)
        for k in (1, BLOCK_SIZE - 1):
            drafts = model.draft(torch.tensor([tokens[-1]]), blocks, embed, head, k)
            assert drafts[0].tolist() == reference_drafts(drafter_dir, reference, features[:n], tokens[-1], k)
    assert layer.kv_cache[0].abs().sum() > 0


@torch.no_grad()
def test_batched_blocks_equal_single_ones(dirs):
    target_dir, drafter_dir = dirs
    reference = load_reference(target_dir)
    model, (embed, head) = build(drafter_dir), target_head(reference)
    for attn in (l.self_attn for l in model.layers):
        attn.bind_caches((torch.zeros(2, 12, CACHE_BLOCK, attn.num_kv_heads, attn.head_dim),))
    tables = torch.tensor([[1, 3, 5], [2, 4, 6]], dtype=torch.int32)
    prompts = [[5, 17, 200, 33, 5, 17, 200], [8, 99, 100, 101, 300]]
    singles = []
    for row, tokens in enumerate(prompts):
        n = len(tokens) - 1
        positions = torch.arange(n)
        slots = tables[row][positions // CACHE_BLOCK].long() * CACHE_BLOCK + positions % CACHE_BLOCK
        model.write_context(target_features(reference, tokens)[:n], positions, slots)
        blocks = DraftBlocks(torch.arange(n, n + BLOCK_SIZE), tables[row:row + 1], torch.tensor([n]), [n], BLOCK_SIZE)
        singles.append(model.draft(torch.tensor([tokens[-1]]), blocks, embed, head, 3)[0].tolist())
    lens = [len(t) - 1 for t in prompts]
    positions = torch.cat([torch.arange(n, n + BLOCK_SIZE) for n in lens])
    batched = model.draft(torch.tensor([t[-1] for t in prompts]), DraftBlocks(positions, tables, torch.tensor(lens), lens, BLOCK_SIZE),
                          embed, head, 3)
    assert batched.tolist() == singles


def test_config_reads_the_z_lab_layout(dirs):
    _, drafter_dir = dirs
    config = DFlashConfig.read(drafter_dir)
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (BLOCK_SIZE, 3, (0, 2))
    assert config.max_drafts == BLOCK_SIZE - 1
    # z-lab's default spread of the layers read, when the config does not list them
    assert evenly_spaced_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert evenly_spaced_layer_ids(28, 1) == (14,)


def _edit(src: str, dst, edit) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    edit(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "not a DFlash drafter"),
    (lambda c: c.update(hidden_size=32), "hidden_size 32 does not match"),
    (lambda c: c.update(vocab_size=1000), "vocab_size 1000 does not match"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, TARGET_LAYERS - 1]), "target_layer_ids [3]"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 9]), "target_layer_ids [9]"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id must be"),
    (lambda c: c.update(block_size=1), "drafts nothing"),
    (lambda c: c.update(use_sliding_window=True, layer_types=["sliding_attention"] * 2), "sliding-window"),
])
def test_config_refusals(dirs, tmp_path, edit, message):
    _, drafter_dir = dirs
    path = _edit(drafter_dir, tmp_path / "edited", edit)
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DFlashConfig.read(path).check_target(64, 384, TARGET_LAYERS, "Qwen3ForCausalLM")


def test_missing_directory_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        DFlashConfig.read(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        DFlashConfig.read(str(tmp_path))


def test_a_target_whose_trunk_keeps_no_layer_outputs_is_refused(dirs):
    from torch import nn

    from metrale.executor.drafters.dflash import check_trunk

    class OwnTrunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(2, 2)

    with pytest.raises(ModelLoadError, match="OwnTrunk's trunk does not expose them"):
        check_trunk(OwnTrunk())
