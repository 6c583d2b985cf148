"""MTP drafting on the DSA families, GLM-5 (`GlmMoeDsaForCausalLM`, full and shared indexer layers)
and DeepSeek-V3.2: the next-n layer is a full layer with its own
lightning indexer (its selection over its own indexer-key cache), so a drafter pass runs the
indexer too. Tiny checkpoints of tests/dsa_checkpoints.py (index_topk 24: the prompts of 40 and
64 tokens attend sparsely, in the trunk and in the MTP layer) with a next-n layer written here in
DeepSeek's layout (a copy of a full layer times 1.5, random eh_proj and norms, shared_head).

Lossless greedy: tokens with MTP drafting (chained k = 2) == transformers' (which ignores the
layer), batched prompts of mixed lengths; drafts proposed; every block back in the pool; the MTP
layer selects with its own indexer.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from dsa_checkpoints import make_dsa_checkpoint
from metrale import LLM, SamplingParams
from test_generation_vs_hf import make_prompts

NEW_TOKENS = 10


def prompts() -> list[list[int]]:
    """Mixed lengths, two past index_topk (24): there the trunk and the MTP layer attend sparsely."""
    return [p[:n] for p, n in zip(make_prompts(), (1, 3, 17, 40, 64))]


def write_nextn_layer(base: str, path: str) -> None:
    """`base` with next-n layer N (N = num_hidden_layers): full layer N - 2's tensors (its indexer's
    included) times 1.5, plus enorm, hnorm, eh_proj and shared_head; num_nextn_predict_layers 1."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    weights = load_file(os.path.join(path, "model.safetensors"))
    source, target = f"model.layers.{n - 2}.", f"model.layers.{n}."  # n - 2: a full layer in both families
    g = torch.Generator().manual_seed(5)
    mtp = {name.replace(source, target): 1.5 * t for name, t in weights.items() if name.startswith(source)}
    mtp[target + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{target}{norm}.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    mtp[target + "shared_head.head.weight"] = weights["lm_head.weight"] * 2
    save_file({**weights, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config, num_nextn_predict_layers=1), f)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_greedy_tokens_with_mtp_equal_transformers(family, tmp_path):
    base = make_dsa_checkpoint(str(tmp_path / "base"), family)
    reference = load_reference(base)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts()]
    path = str(tmp_path / "with_mtp")
    write_nextn_layer(base, path)
    llm = LLM(path, dtype="float32", device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    scheduler, runner = llm.llm_engine.scheduler, llm.llm_engine.runner
    assert scheduler.spec_stats.num_drafts > 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert runner.drafter.sha256 == runner.model.mtp_sha256 is not None
    # The MTP layer selects with its own indexer, not another layer's selection.
    attention = runner.drafter.layer.block.self_attn
    assert attention.indexer is not None and attention in runner.drafter.cached_layers()
