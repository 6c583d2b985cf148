"""Speculative decoding (n-gram) on hybrid models, Qwen3-Next and Qwen3.5: a verify step keeps
the linear-attention state after each draft and the runner keeps the one of the last accepted
position (layers/linear_attention/draft_states.py), so greedy tokens are transformers' and those
of the same model without speculation, with drafts both accepted and rejected: batched prompts
of mixed lengths, chunked prefill with forced preemption, prefix hits resuming from state
checkpoints, n = 2, tensor parallel over two CPU ranks, and the Gated DeltaNet Triton backend
(interpreter).

The checkpoints are built with initializer_range 0.05 (hybrid_checkpoints.SPEC_INITIALIZER_RANGE:
drafts are then accepted in some steps and rejected in others, both asserted).
"""

from __future__ import annotations

import pytest

from checkpoints import load_reference, reference_greedy
from hybrid_checkpoints import SPEC_INITIALIZER_RANGE, make_hybrid_checkpoint
from hybrid_checkpoints import spec_prompts as make_prompts
from metrale import LLM, SamplingParams

FAMILIES = ["qwen3_next", "qwen3_5"]
NEW_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_hybrid_checkpoint(str(tmp_path_factory.mktemp(f"spec_{family}")), family,
                                                   initializer_range=SPEC_INITIALIZER_RANGE)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def expected(checkpoint):
    cache = {}

    def get(family):
        if family not in cache:
            model = load_reference(checkpoint(family))
            cache[family] = [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]
        return cache[family]

    return get


def engine(path, speculative=True, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", **({"speculative_config": SPEC} if speculative else {}),
               **kwargs)


def greedy(llm: LLM, prompts=None, params=GREEDY) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in (prompts or make_prompts())]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_accepted_rejected_and_idle(llm: LLM) -> None:
    stats = llm.llm_engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # some drafts kept, some rolled back
    scheduler = llm.llm_engine.scheduler
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.kv.num_free_state_slots == scheduler.max_num_seqs


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_and_plain_decoding(family, checkpoint, expected):
    llm = engine(checkpoint(family))
    assert greedy(llm) == expected(family)
    assert_accepted_rejected_and_idle(llm)
    assert greedy(engine(checkpoint(family), speculative=False)) == expected(family)
    # The memory plan counts the verify steps' scratch state: k slots per running sequence.
    plan, caches = llm.llm_engine.memory_plan, llm.llm_engine.runner.caches
    assert plan.num_draft_state_slots == plan.max_num_seqs * SPEC["num_speculative_tokens"] > 0
    assert caches.num_slots == plan.num_state_slots + plan.num_draft_state_slots + 1
    assert caches.state_bytes == plan.state_cache_bytes


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_with_preemption(family, checkpoint, expected):
    # 24 blocks of 4 = 96 tokens for ~230 tokens of requests: preemptions, some with a verify
    # step in flight; 8-token chunks (drafts only ever at a decode position).
    llm = engine(checkpoint(family), num_kv_blocks=24, block_size=4, max_num_batched_tokens=8)
    assert greedy(llm) == expected(family)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_accepted_rejected_and_idle(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_resume_from_checkpoints_without_drafts(family, checkpoint, expected):
    llm = engine(checkpoint(family), block_size=8)
    assert greedy(llm) == expected(family)
    kv = llm.llm_engine.scheduler.kv
    saved, hits = kv.checkpoints_saved_total, kv.prefix_hits_total
    assert greedy(llm) == expected(family)  # resumed from checkpoints saved by requests that speculated
    assert saved > 0 and kv.prefix_hits_total > hits
    assert_accepted_rejected_and_idle(llm)


def test_two_children_each_drafting(checkpoint, expected):
    llm = engine(checkpoint("qwen3_next"))
    prompts = make_prompts()
    params = SamplingParams(temperature=0, n=2, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[2:4]], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected("qwen3_next")[2:4]]
    assert_accepted_rejected_and_idle(llm)


def test_tensor_parallel_two_ranks(checkpoint, expected):
    llm = engine(checkpoint("qwen3_5"), tp_size=2, max_num_batched_tokens=16)
    try:
        assert greedy(llm) == expected("qwen3_5")
        assert_accepted_rejected_and_idle(llm)
    finally:
        llm.close()


def test_triton_linear_attention_under_the_interpreter(checkpoint, expected):
    # The Gated DeltaNet Triton backend (conv, chunked delta rule, the verify kernel) through
    # TRITON_INTERPRET=1, everything else on the PyTorch reference: a whole engine under the
    # interpreter takes minutes per prompt. Two prompts: one beside the other's prefill chunks.
    pytest.importorskip("triton")
    from metrale.layers.linear_attention.triton_backend import TritonGDNBackend

    llm = engine(checkpoint("qwen3_next"), max_num_batched_tokens=8)
    runner = llm.llm_engine.runner
    runner.backends["gdn"] = TritonGDNBackend()
    assert runner.backend_names == "attention torch, gdn triton"
    prompts = make_prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert greedy(llm, [prompts[2], prompts[0]], params) == [expected("qwen3_next")[i][:12] for i in (2, 0)]
    assert_accepted_rejected_and_idle(llm)
