"""Speculative decoding of requests that follow a grammar: each row of a verify step is masked by
the grammar's state after the drafts before it (structured/matchers.py), so a draft the grammar
refuses is rejected. Greedy constrained outputs equal the engine's without speculation, with
prompt-lookup drafts accepted, synchronous and asynchronous (the drafter in the runner);
sampled ones follow their grammars."""

import pytest

from metrale import LLM, SamplingParams
from metrale.messages.structured_outputs import StructuredOutputsParams as Spec
from test_constrained_generation import GRAMMAR, SCHEMA, _check, _generate

pytest.importorskip("xgrammar")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Outputs that repeat themselves, after prompts that hold them: prompt lookup drafts the parts the
# grammar forces, and the model's picks where the history repeats.
REGEX = r"(cat-[0-9]{2} ){3,6}"
CHOICES = ["red", "green", "blue sky"]
KINDS = [Spec(regex=REGEX), Spec(json=SCHEMA), Spec(choice=CHOICES), Spec(grammar=GRAMMAR)]
PROMPTS = ["cat-12 cat-34 cat-12 cat-56 cat-12 cat-34", '{"name": "ab", "age": 7, "tags": ["a", "b"]}',
           "red green blue sky red", "1+2+(3-4)+1+2+(3-4)"]
FREE = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _batch(**params):
    """Each kind after each prompt, and a free request between them."""
    batch = [(p, SamplingParams(max_tokens=80, structured_outputs=spec, **params)) for spec in KINDS for p in PROMPTS]
    return batch[:3] + [(PROMPTS[0], FREE)] + batch[3:]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def plain(checkpoint):
    llm = LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=512)
    return [o.token_ids for o in _generate(llm, _batch(temperature=0))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_constrained_outputs_equal_plain_decodings_with_drafts_accepted(checkpoint, plain, async_scheduling):
    llm = LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=512,
              speculative_config=NGRAM, async_scheduling=async_scheduling)
    # Asynchronous: the drafter runs in the runner, and constrained steps are read before planning.
    assert llm.llm_engine.scheduler.drafts_on_device == async_scheduling
    batch = _batch(temperature=0)
    outputs = _generate(llm, batch)
    assert [o.token_ids for o in outputs] == plain
    for (_, params), out in zip(batch, outputs):
        if params.structured_outputs is not None and out.finish_reason == "stop":
            _check(params.structured_outputs, out.text)
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    # Constrained requests alone: their own drafts are accepted.
    accepted = stats.num_accepted_tokens
    _generate(llm, [b for b in batch if b[1].structured_outputs is not None and b[1].structured_outputs.regex])
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > accepted
    assert len(llm.llm_engine.runner.matchers) <= 1  # finished requests' matchers dropped with the next plan


def test_sampled_constrained_outputs_follow_their_grammars(checkpoint):
    llm = LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=512,
              speculative_config=NGRAM)
    batch = [(p, SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=spec))
             for spec in (Spec(regex=REGEX), Spec(json=SCHEMA)) for seed, p in enumerate(PROMPTS[:2] * 2)]
    outputs = _generate(llm, batch)
    for (_, params), out in zip(batch, outputs):
        assert out.finish_reason == "stop", out.text
        _check(params.structured_outputs, out.text)
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    # Seeded: the same tokens alone as batched.
    alone = _generate(llm, batch[:1])[0]
    assert alone.token_ids == outputs[0].token_ids


def test_two_ranks_draft_constrained_requests_as_one_rank_does(checkpoint, plain):
    """Every rank samples, so every rank masks its verify rows over the same drafts: tp=2 gives
    one rank's greedy tokens (= the plain engine's)."""
    from parallel_cases import free_port

    batch = _batch(temperature=0)
    subset = [0, 3, 5, 9]  # a regex, the free request, a JSON schema, a choice
    llm = LLM(checkpoint, dtype="float32", device="cpu", tp_size=2, master_port=free_port(), num_kv_blocks=256,
              max_model_len=512, speculative_config=NGRAM)
    try:
        outputs = _generate(llm, [batch[i] for i in subset])
        assert [o.token_ids for o in outputs] == [plain[i] for i in subset]
        assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        llm.close()
