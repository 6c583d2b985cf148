"""DeepSeek-V3 (MLA attention, group-limited MoE): greedy token ids identical to transformers,
float32, on tiny random checkpoints (tests/mla_checkpoints.py; a low-rank and a plain query).

As test_moe_vs_hf.py: seven prompts of lengths 1..250 together, then the same prompts again on
the same engine, whose prefixes now hit the cache; every prompt chunked by a 16-token step
budget; a KV pool so small that requests are preempted and recomputed. Plus what the latent
cache costs in the memory plan (the tiny model's, and DeepSeek-V3's 576-wide latent), tensor
parallelism over two CPU ranks (heads split, the latent replicated), the multi-token-prediction
layer of a checkpoint loaded without changing the tokens (more: test_mtp_weights.py), and the refusal of a config
option met does not implement (the fp8 latent cache: test_mla_triton_fp8.py). FP8 weights: tests/quantization/test_fp8_deepseek.py.
"""

import json
import os
import shutil

import pytest
import torch

from family_cases import assert_idle, family_fixtures, generate_twice
from metrale import LLM, SamplingParams
from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelLoadError, load_model_config
from metrale.models.registry import supported_architectures
from parallel_cases import free_port
from metrale.startup.memory import plan_memory
from mla_checkpoints import DEEPSEEK_V3, MLA_FAMILIES, make_mla_checkpoint
from test_generation_vs_hf import NEW_TOKENS, generate, make_prompts

FAMILIES = sorted(MLA_FAMILIES)


mla_checkpoint, expected = family_fixtures(make_mla_checkpoint, "mla_checkpoint")


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_then_prefix_hits_match_transformers(family, mla_checkpoint, expected):
    llm, first, second, hits = generate_twice(mla_checkpoint(family))
    assert first == second == expected(family)
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits  # every prompt of 9+ tokens reused its cached latents
    assert_idle(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_transformers(family, mla_checkpoint, expected):
    llm, tokens = generate(mla_checkpoint(family), max_num_batched_tokens=16)
    assert tokens == expected(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_matches_transformers(family, mla_checkpoint, expected):
    # 70 blocks of 4 = 280 tokens for ~700 tokens of requests; the longest (262) still fits alone.
    llm, tokens = generate(mla_checkpoint(family), num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected(family)
    assert_idle(llm)


def test_memory_plan_counts_one_latent_per_token_and_layer(mla_checkpoint):
    path = mla_checkpoint("deepseek_v3")
    args = EngineArgs(model=path, dtype="bfloat16")
    config = load_model_config(path, args.dtype, torch.device("cpu"), None, supported_architectures())
    plan = plan_memory(args, config, torch.device("cpu"))
    assert plan.kv_bytes_per_token == 3 * (32 + 16) * 2  # 3 layers x [kv_lora_rank + qk_rope] x bf16
    assert "mla: 3 layer(s) 0-2, 1 x (48,) bfloat16 per token (96 B/token each)" in plan.table()


def test_tensor_parallel_heads_match_transformers(mla_checkpoint, expected):
    llm, tokens = generate(mla_checkpoint("deepseek_v3"), max_num_batched_tokens=16, tp_size=2,
                           master_port=free_port())
    try:
        assert llm.llm_engine.executor.world_size == 2
    finally:
        llm.llm_engine.shutdown()
    assert tokens == expected("deepseek_v3")


def test_memory_plan_of_deepseek_v3(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    args = EngineArgs(model=str(tmp_path), load_format="dummy", max_model_len=32768,
                      hf_overrides={"num_hidden_layers": 4})
    config = load_model_config(str(tmp_path), args.dtype, torch.device("cuda"), args.max_model_len,
                               supported_architectures(), args.config_overrides)
    plan = plan_memory(args, config, torch.device("cuda"), 141 * 2**30)
    assert plan.kv_bytes_per_token == 4 * (512 + 64) * 2  # one bf16 latent per token and layer, no K/V heads
    assert "mla: 4 layer(s) 0-3, 1 x (576,) bfloat16 per token (1,152 B/token each)" in plan.table()


def test_multi_token_prediction_layers_leave_the_tokens_unchanged(mla_checkpoint, expected, tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "with_mtp")
    shutil.copytree(mla_checkpoint("deepseek_v3"), path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    mtp = {name.replace("model.layers.2.", "model.layers.3."): t.clone() for name, t in weights.items()
           if name.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    mtp.update({f"model.layers.3.{norm}.weight": torch.ones(64) for norm in ("enorm", "hnorm", "shared_head.norm")})
    save_file({**weights, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(path, dtype="float32", device="cpu")
    assert len(llm.llm_engine.runner.model.mtp) == 1  # loaded (models/mtp.py), not run
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()[:3]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected("deepseek_v3")[:3]


def test_unsupported_config_options_are_refused_by_name(mla_checkpoint):
    with pytest.raises(ModelLoadError, match="config options met does not implement: attention_bias=True"):
        LLM(mla_checkpoint("deepseek_v3"), device="cpu", hf_overrides={"attention_bias": True})
