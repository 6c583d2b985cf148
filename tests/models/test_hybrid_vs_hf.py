"""Hybrid linear-attention families (Qwen3-Next, Qwen3.5 dense and MoE): greedy token ids
identical to transformers, float32.

As test_generation_vs_hf.py: seven prompts of lengths 1..250 together; every prompt chunked by
a 16-token step budget, and by a 100-token one (its chunk boundaries fall inside the delta
rule's 64-token chunks); a KV pool so small that requests are preempted and recomputed (their
state slots reset); asynchronous scheduling; and a second pass over the same prompts whose
prefix hits resume from saved state checkpoints.
"""

import pytest

from checkpoints import load_reference, reference_greedy
from hybrid_checkpoints import HYBRID_FAMILIES, make_hybrid_checkpoint
from metrale import LLM, SamplingParams
from test_generation_vs_hf import NEW_TOKENS, generate, make_prompts

FAMILIES = sorted(HYBRID_FAMILIES)


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_hybrid_checkpoint(str(tmp_path_factory.mktemp(f"ckpt_{family}")), family)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def expected(hybrid_checkpoint):
    cache = {}

    def get(family):
        if family not in cache:
            model = load_reference(hybrid_checkpoint(family))
            cache[family] = [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]
        return cache[family]

    return get


def assert_idle(llm):
    scheduler = llm.llm_engine.scheduler
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.kv.num_free_state_slots == scheduler.max_num_seqs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kwargs", [{}, dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=100),
                                    dict(async_scheduling=True, max_num_batched_tokens=32)],
                         ids=["batched", "chunked16", "chunked100", "async"])
def test_greedy_matches_transformers(family, kwargs, hybrid_checkpoint, expected):
    llm, tokens = generate(hybrid_checkpoint(family), **kwargs)
    assert tokens == expected(family)
    assert_idle(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_matches_transformers(family, hybrid_checkpoint, expected):
    # 70 blocks of 4 = 280 tokens for ~700 tokens of requests; the longest (262) still fits alone.
    llm, tokens = generate(hybrid_checkpoint(family), num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected(family)
    assert_idle(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_resume_from_state_checkpoints(family, hybrid_checkpoint, expected):
    llm = LLM(hybrid_checkpoint(family), dtype="float32", device="cpu", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    kv = llm.llm_engine.scheduler.kv
    saved, hits = kv.checkpoints_saved_total, kv.prefix_hits_total
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == second == expected(family)
    assert saved > 0 and kv.prefix_hits_total > hits  # every prompt of 9+ tokens resumed mid-way
    assert_idle(llm)
