"""The state-slot pool end to end, on a toy stateful model (tests/toy_state_model.py): its
greedy tokens equal a cache-free reference batched, chunked, preempted, under asynchronous
scheduling and with prefix hits; an abort frees its slot at once; at idle every slot and block is
free again."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.config.engine_args import EngineArgs
from metrale.messages.sampling_params import SamplingParams as Params
from metrale.startup import build_llm_engine
from test_generation_vs_hf import make_prompts
from toy_state_model import reference_greedy, reference_model, toy_checkpoint

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def toy(checkpoint_factory, tmp_path_factory):
    llama = checkpoint_factory("llama")
    path = toy_checkpoint(llama, str(tmp_path_factory.mktemp("toy") / "ckpt"))
    model = reference_model(llama)
    return path, [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]


def run(path, **kwargs):
    llm = LLM(path, dtype="float32", device="cpu", **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def assert_idle(llm):
    kv = llm.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_state_slots == llm.llm_engine.scheduler.max_num_seqs


@pytest.mark.parametrize("kwargs", [{}, dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=100),
                                    dict(async_scheduling=True, max_num_batched_tokens=16)],
                         ids=["batched", "chunked16", "chunked100", "async"])
def test_matches_the_cache_free_reference(toy, kwargs):
    path, expected = toy
    llm, tokens = run(path, **kwargs)
    assert tokens == expected
    assert_idle(llm)


def test_preemption_resets_the_slot(toy):
    path, expected = toy
    llm, tokens = run(path, num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert tokens == expected
    assert_idle(llm)


def test_prefix_hits_resume_from_a_checkpoint(toy):
    path, expected = toy
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    kv = llm.llm_engine.scheduler.kv
    hits_before = kv.prefix_hits_total
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == second == expected
    assert kv.checkpoints_saved_total > 0 and kv.prefix_hits_total > hits_before
    assert_idle(llm)


def test_an_abort_frees_the_slot_at_once(toy):
    path, _ = toy
    engine = build_llm_engine(EngineArgs(model=path, dtype="float32", device="cpu", max_num_seqs=4))
    kv = engine.scheduler.kv
    for i, prompt in enumerate(make_prompts()[:3]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, Params(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    assert kv.num_free_state_slots == 1
    engine.abort_request("1")
    assert kv.num_free_state_slots == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_free_state_slots == 4 and kv.num_free_blocks == kv.num_blocks
    engine.step()  # the runner hears of the last finished request with the next plan
    assert not engine.runner.requests


def test_running_sequences_are_bounded_by_the_slots(toy):
    path, expected = toy
    llm, tokens = run(path, max_num_seqs=2)
    assert tokens == expected
    plan = llm.llm_engine.memory_plan
    assert plan.max_num_seqs == 2 and plan.num_state_slots == 2 + plan.num_checkpoint_slots
    assert llm.llm_engine.runner.caches.num_slots == plan.num_state_slots + 1  # and the padding slot
