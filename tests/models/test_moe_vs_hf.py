"""MoE families: greedy token ids identical to transformers, float32.

As test_generation_vs_hf.py: seven prompts of lengths 1..250 together; again with a step
budget of 16 tokens that chunks every prompt; again with a KV pool so small that requests are
preempted and recomputed. Plus the checkpoint layouts: transformers' stacked expert tensors
load like per-expert ones, and a missing expert tensor is an error that names it.
"""

import os
import re
import shutil

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from metrale import LLM
from metrale.config.model_config import ModelLoadError
from moe_checkpoints import MOE_FAMILIES, make_moe_checkpoint
from test_generation_vs_hf import NEW_TOKENS, generate, make_prompts

FAMILIES = sorted(MOE_FAMILIES)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_moe_checkpoint(str(tmp_path_factory.mktemp(f"ckpt_{family}")), family)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def expected(moe_checkpoint):
    cache = {}

    def get(family):
        if family not in cache:
            model = load_reference(moe_checkpoint(family))
            cache[family] = [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_matches_transformers(family, moe_checkpoint, expected):
    _, tokens = generate(moe_checkpoint(family))
    assert tokens == expected(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_transformers(family, moe_checkpoint, expected):
    _, tokens = generate(moe_checkpoint(family), max_num_batched_tokens=16)
    assert tokens == expected(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_matches_transformers(family, moe_checkpoint, expected):
    # 70 blocks of 4 = 280 tokens for ~700 tokens of requests; the longest (262) still fits alone.
    llm, tokens = generate(moe_checkpoint(family), num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected(family)


def _rewrite(src, dst, edit):
    """Copy a checkpoint directory with its tensors passed through `edit(dict) -> dict`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})
    return dst


def _stack_experts(tensors):
    """Per-expert tensors -> transformers' in-memory layout: experts.gate_up_proj [E, 2I, H] and
    experts.down_proj [E, H, I] per layer (MiniMax's w1/w3/w2 renamed to gate/up/down)."""
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    groups, out = {}, {}
    for name, tensor in tensors.items():
        match = re.match(r"(.+\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if match is None:
            out[name] = tensor
            continue
        groups.setdefault(match[1], {})[(int(match[2]), names.get(match[3], match[3]))] = tensor
    for prefix, parts in groups.items():
        experts = range(1 + max(e for e, _ in parts))
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in experts])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in experts])
    return out


@pytest.mark.parametrize("family", ["minimax_m2", "qwen3_moe"])
def test_stacked_expert_tensors_load(family, moe_checkpoint, expected, tmp_path):
    path = _rewrite(moe_checkpoint(family), tmp_path / "stacked", _stack_experts)
    _, tokens = generate(str(path))
    assert tokens == expected(family)


def test_missing_expert_tensor_is_named(moe_checkpoint, tmp_path):
    victim = "model.layers.0.mlp.experts.3.up_proj.weight"
    path = _rewrite(moe_checkpoint("qwen3_moe"), tmp_path / "missing",
                    lambda t: {k: v for k, v in t.items() if k != victim})
    with pytest.raises(ModelLoadError, match=re.escape("model.layers.0.mlp.experts.w13[w3, expert 3]")):
        LLM(str(path), dtype="float32", device="cpu")
