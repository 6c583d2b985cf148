"""What the speculative decoding end-to-end tests share: tiny checkpoints of two dense families
and one MoE family, prompts of mixed lengths (two of them repetitive, so prompt lookup drafts
and the drafts are accepted), transformers' greedy tokens for them (built once per module), the
n-gram configuration and the checks every run ends with."""

from __future__ import annotations

import random

import pytest

from checkpoints import load_reference, make_checkpoint, reference_greedy
from metrale import LLM, SamplingParams
from moe_checkpoints import make_moe_checkpoint

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
