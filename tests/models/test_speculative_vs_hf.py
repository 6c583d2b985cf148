"""Speculative decoding with the n-gram drafter, end to end against transformers: greedy tokens
identical to transformers' and to the same engine without speculation for Llama, Qwen3 and
Qwen3-MoE, batched prompts of mixed lengths (some repetitive, so drafts are accepted), also under
chunked prefill with forced preemption. tests/models/test_speculative_engine.py has the rest."""

from __future__ import annotations

import pytest

from speculative_cases import FAMILIES, assert_accepted_and_idle, checkpoint, engine, expected, greedy  # noqa: F401

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
