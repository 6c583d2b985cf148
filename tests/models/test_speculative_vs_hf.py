"""Speculative decoding with the n-gram drafter, end to end on tiny random checkpoints: greedy
tokens identical to transformers' and to the same engine without speculation, for two dense
families and one MoE family, batched prompts of mixed lengths (some repetitive, so drafts are
accepted), under chunked prefill, forced preemption and prefix hits; seeded sampled requests
identical alone and batched; the metrics; tp=2 on the CPU; refusals of what is not built."""

from __future__ import annotations

import random

import pytest

from checkpoints import load_reference, make_checkpoint, reference_greedy
from hybrid_checkpoints import make_hybrid_checkpoint
from metrale import LLM, SamplingParams
from moe_checkpoints import make_moe_checkpoint
from parallel_cases import free_port  # noqa: F401 - the tp=2 case below starts worker ranks

NEW_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
FAMILIES = {"llama": make_checkpoint, "qwen3": make_checkpoint, "qwen3_moe": make_moe_checkpoint}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    rand = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 40, 70)]
    return rand + [[5, 6, 7, 8, 9] * 6, [20, 21, 22] * 15 + [23]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = FAMILIES[family](str(tmp_path_factory.mktemp(f"spec_{family}")), family)
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


def greedy(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_accepted_and_idle(llm: LLM) -> None:
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    kv = llm.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers_and_plain_decoding(family, checkpoint, expected):
    llm = engine(checkpoint(family))
    assert greedy(llm) == expected(family)
    assert_accepted_and_idle(llm)
    if family == "llama":  # the other families' plain runs are tests/models/test_*_vs_hf.py's
        assert greedy(engine(checkpoint(family), speculative=False)) == expected(family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_prefill_and_preemption(family, checkpoint, expected):
    # A 12-token step budget chunks the long prompts beside the others' verify steps; 40 blocks of
    # 4 tokens (160) for ~370 tokens of requests force preemptions.
    llm = engine(checkpoint(family), max_num_batched_tokens=12, num_kv_blocks=40, block_size=4)
    assert greedy(llm) == expected(family)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_accepted_and_idle(llm)


@pytest.mark.parametrize("family", ["llama"])
def test_prefix_hits(family, checkpoint, expected):
    llm = engine(checkpoint(family), block_size=8, enable_prefix_caching=True)
    assert greedy(llm) == expected(family)
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    assert greedy(llm) == expected(family)
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits
    assert_accepted_and_idle(llm)


def test_seeded_sampling_alone_equals_batched_and_metrics(checkpoint):
    llm = engine(checkpoint("llama"))
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=10 + i,
                             max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], [q], use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert batched == alone
    # n = 2: two children, each its own stream; each still gives its tokens alone.
    pair = llm.generate([prompts[4]], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    assert len(pair) == 2 and all(len(c.token_ids) == 16 for c in pair)
    metrics = {(m.name, m.labels.get("position")): m.value for m in llm.get_metrics()}
    stats = llm.llm_engine.scheduler.spec_stats
    assert metrics[("met:spec_decode_num_drafts_total", None)] == stats.num_drafts > 0
    assert metrics[("met:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert metrics[("met:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    assert metrics[("met:spec_decode_num_accepted_tokens_per_pos_total", "0")] == stats.accepted_per_position[0]
    # Generated tokens count what requests received, never a rejected draft.
    assert metrics[("met:generation_tokens_total", None)] == sum(map(len, batched + alone)) + 32


def test_tensor_parallel_two_ranks(checkpoint, expected):
    llm = engine(checkpoint("qwen3"), tp_size=2, max_num_batched_tokens=16)
    try:
        assert greedy(llm) == expected("qwen3")
        assert_accepted_and_idle(llm)
    finally:
        llm.close()


def test_models_with_recurrent_state_are_refused(tmp_path):
    path = make_hybrid_checkpoint(str(tmp_path), "qwen3_next")
    with pytest.raises(ValueError, match="per-request state"):
        engine(path)
