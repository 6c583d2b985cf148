"""Greedy token ids identical to transformers, float32, for every supported family.

Seven prompts of lengths 1..250 run together; again with a step budget that chunks every
prompt; again with a KV pool so small that requests are preempted and recomputed.
"""

import random

import pytest

from checkpoints import FAMILIES, load_reference, reference_greedy
from metrale import LLM, SamplingParams

PROMPT_LENGTHS = [1, 3, 17, 64, 100, 181, 250]
NEW_TOKENS = 12


def make_prompts(vocab: int = 384, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(checkpoint_factory):
    cache = {}

    def get(family):
        if family not in cache:
            path = checkpoint_factory(family)
            model = load_reference(path)
            cache[family] = [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]
        return cache[family]

    return get


def generate(path, **engine_kwargs):
    llm = LLM(path, dtype="float32", device="cpu", **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_greedy_matches_transformers(family, checkpoint_factory, expected):
    _, tokens = generate(checkpoint_factory(family))
    assert tokens == expected(family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_prefill_matches_transformers(family, checkpoint_factory, expected):
    llm, tokens = generate(checkpoint_factory(family), max_num_batched_tokens=16)
    assert tokens == expected(family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_preemption_matches_transformers(family, checkpoint_factory, expected):
    # 70 blocks of 4 = 280 tokens for ~700 tokens of requests; the longest (262) still fits alone.
    llm, tokens = generate(checkpoint_factory(family), num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected(family)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
