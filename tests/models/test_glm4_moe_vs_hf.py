"""GLM-4.5 (`Glm4MoeForCausalLM`): greedy token ids identical to transformers, float32, on tiny
random checkpoints (tests/moe_checkpoints.py: `glm4_moe` with per-head q/k norms, half-rotary
heads and group-limited routing; `glm4_moe_no_qk_norm` without the norms, a quarter rotated, one
expert group).

Seven prompts of lengths 1..250 together, then the same prompts again on the same engine, whose
prefixes now hit the cache; every prompt chunked by a 16-token step budget; a KV pool so small
that requests are preempted and recomputed; tensor parallelism over two CPU ranks. Plus the
multi-token-prediction layer of a checkpoint loaded without changing the tokens (more:
test_mtp_weights.py), and the config options met does not run
refused by name.
"""

import os
import re
import shutil

import pytest
import torch

from family_cases import assert_idle, family_fixtures, generate_twice
from metrale import LLM, SamplingParams
from metrale.config.model_config import ModelLoadError
from moe_checkpoints import make_moe_checkpoint
from parallel_cases import free_port
from test_generation_vs_hf import NEW_TOKENS, generate, make_prompts

FAMILIES = ["glm4_moe", "glm4_moe_no_qk_norm"]


glm_checkpoint, expected = family_fixtures(make_moe_checkpoint, "glm_checkpoint")


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_then_prefix_hits_match_transformers(family, glm_checkpoint, expected):
    llm, first, second, hits = generate_twice(glm_checkpoint(family))
    assert first == second == expected(family)
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits  # every prompt of 9+ tokens reused its cached K/V
    assert_idle(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_transformers(family, glm_checkpoint, expected):
    _, tokens = generate(glm_checkpoint(family), max_num_batched_tokens=16)
    assert tokens == expected(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_matches_transformers(family, glm_checkpoint, expected):
    # 70 blocks of 4 = 280 tokens for ~700 tokens of requests; the longest (262) still fits alone.
    llm, tokens = generate(glm_checkpoint(family), num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected(family)
    assert_idle(llm)


def test_tensor_parallel_matches_transformers(glm_checkpoint, expected):
    # Two CPU ranks: one KV head each (per-head q/k norms stay local), experts' and MLPs'
    # intermediate dims halved, the float32 router replicated.
    llm, tokens = generate(glm_checkpoint("glm4_moe"), max_num_batched_tokens=16, tp_size=2,
                           master_port=free_port())
    try:
        assert llm.llm_engine.executor.world_size == 2
    finally:
        llm.llm_engine.shutdown()
    assert tokens == expected("glm4_moe")


def test_multi_token_prediction_layer_leaves_the_tokens_unchanged(glm_checkpoint, expected, tmp_path):
    # GLM-4.5 ships its next-n layer as model.layers.{num_hidden_layers}.* (a decoder layer plus
    # eh_proj, enorm, hnorm, shared_head); config.json's num_nextn_predict_layers says so.
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "with_mtp")
    shutil.copytree(glm_checkpoint("glm4_moe"), path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    mtp = {name.replace("model.layers.1.", "model.layers.2."): t.clone() for name, t in weights.items()
           if name.startswith("model.layers.1.")}
    mtp.update({"model.layers.2.eh_proj.weight": torch.zeros(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
                "model.layers.2.hnorm.weight": torch.ones(64),
                "model.layers.2.shared_head.norm.weight": torch.ones(64),
                "model.layers.2.shared_head.head.weight": weights["lm_head.weight"].clone()})
    save_file({**weights, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(path, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()[:3]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected("glm4_moe")[:3]


@pytest.mark.parametrize("overrides,message", [
    ({"hidden_act": "gelu"}, "Glm4MoeForCausalLM with hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3}},
     "config options met does not implement: partial_rotary_factor=0.3 (rotary dim 9 of head_dim 32)"),
])
def test_unsupported_config_options_are_refused_by_name(glm_checkpoint, overrides, message):
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        LLM(glm_checkpoint("glm4_moe"), device="cpu", hf_overrides=overrides)
