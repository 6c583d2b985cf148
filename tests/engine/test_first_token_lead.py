"""Under asynchronous scheduling a step that gives most of its requests their first token is read in
the step() call that launched it (`LLMEngine._first_tokens_lead`); steps of decodes stay in flight:

- the call that runs a prompt's last prefill chunk returns that request's first token, with the
  prompt split over several chunks (not one call later, as when such a step is left in flight);
- after a decode-only call a step is in flight (`engine._inflight`), so the overlap is kept;
- greedy tokens == the synchronous engine's, with prompts of several lengths, chunked prefill and
  preemption forced.
"""

import importlib.util
import os

import pytest

from metrale.config.engine_args import EngineArgs
from metrale.engine.engine import LLMEngine
from metrale.messages.sampling_params import SamplingParams
from metrale.startup import build_llm_engine


def _async_scheduling_tests():
    """tests/models/test_async_scheduling.py, for its prompts (a module of another test folder)."""
    spec = importlib.util.spec_from_file_location(
        "async_scheduling_cases", os.path.join(os.path.dirname(__file__), "..", "models", "test_async_scheduling.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prompts = _async_scheduling_tests().prompts
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engine_of(path, **kwargs) -> LLMEngine:
    return build_llm_engine(EngineArgs(model=path, device="cpu", **kwargs))


def record_plans(engine, monkeypatch) -> list:
    """Every plan the scheduler makes, one per step() call, in order."""
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        plan, ended = schedule()
        plans.append(plan)
        return plan, ended

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    return plans


def is_decode_only(plan) -> bool:
    counts = plan.num_scheduled_tokens
    return bool(counts) and not plan.new_requests and plan.total_num_scheduled_tokens == len(counts)


def run_one(engine, plans, prompt_len: int):
    """One request of `prompt_len` tokens, stepped to the end. Returns the index of the call whose
    plan ran the prompt's last chunk, the index of the first call that returned a token, the
    number of calls that ran a piece of the prompt, and the in-flight state after each call."""
    engine.add_request("r", {"prompt_token_ids": [3 + i % 300 for i in range(prompt_len)]}, GREEDY)
    last_chunk_call = first_token_call = None
    scheduled = 0
    prefill_calls = 0
    inflight_after = []
    call = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        plan = plans[-1]
        if scheduled < prompt_len and "r" in plan.num_scheduled_tokens:
            prefill_calls += 1
            scheduled += plan.num_scheduled_tokens["r"]
            if scheduled >= prompt_len:
                last_chunk_call = call
        if first_token_call is None and any(o.request_id == "r" and o.outputs[0].token_ids for o in outs):
            first_token_call = call
        inflight_after.append((plan, engine._inflight is not None))
        call += 1
        assert call < 200, "the request never finished"
    return last_chunk_call, first_token_call, prefill_calls, inflight_after


def test_first_token_in_the_call_that_ran_the_last_chunk(checkpoint_factory, monkeypatch):
    engine = engine_of(checkpoint_factory("llama"), async_scheduling=True, max_num_batched_tokens=16)
    assert engine.async_scheduling
    plans = record_plans(engine, monkeypatch)
    last_chunk_call, first_token_call, prefill_calls, _ = run_one(engine, plans, 50)
    assert prefill_calls == 4  # 16 + 16 + 16 + 2: the chunking did happen
    assert first_token_call == last_chunk_call == 3


def test_decode_steps_stay_in_flight(checkpoint_factory, monkeypatch):
    engine = engine_of(checkpoint_factory("llama"), async_scheduling=True, max_num_batched_tokens=16)
    plans = record_plans(engine, monkeypatch)
    _, _, _, inflight_after = run_one(engine, plans, 50)
    decodes = [inflight for plan, inflight in inflight_after if is_decode_only(plan)]
    assert len(decodes) == GREEDY.max_tokens - 1
    assert all(decodes), "a decode-only step was read back in the call that launched it: no overlap"
    prefills = [inflight for plan, inflight in inflight_after if plan.num_scheduled_tokens and not is_decode_only(plan)]
    # A chunk short of the prompt's end samples nothing and stays in flight; the last one leads.
    assert prefills == [True, True, True, False]


def test_without_the_lead_the_first_token_comes_one_call_later(checkpoint_factory, monkeypatch):
    """The check above can fail: with every step left in flight, the first token waits a call."""
    monkeypatch.setattr(LLMEngine, "_first_tokens_lead", lambda self, plan: False)
    engine = engine_of(checkpoint_factory("llama"), async_scheduling=True, max_num_batched_tokens=16)
    plans = record_plans(engine, monkeypatch)
    last_chunk_call, first_token_call, _, _ = run_one(engine, plans, 50)
    assert first_token_call == last_chunk_call + 1


def test_synchronous_engine_reads_every_step_at_once(checkpoint_factory, monkeypatch):
    engine = engine_of(checkpoint_factory("llama"), async_scheduling=False, max_num_batched_tokens=16)
    plans = record_plans(engine, monkeypatch)
    last_chunk_call, first_token_call, _, inflight_after = run_one(engine, plans, 50)
    assert first_token_call == last_chunk_call == 3
    assert not any(inflight for _, inflight in inflight_after)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_match_the_synchronous_engine(family, checkpoint_factory, monkeypatch):
    path = checkpoint_factory(family)
    kwargs = dict(num_kv_blocks=70, block_size=4, max_num_batched_tokens=32)  # chunked prefill, preemption
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    leads = []
    first_tokens_lead = LLMEngine._first_tokens_lead

    def counting(self, plan):
        leads.append(first_tokens_lead(self, plan))
        return leads[-1]

    monkeypatch.setattr(LLMEngine, "_first_tokens_lead", counting)

    def tokens(async_scheduling):
        engine = engine_of(path, async_scheduling=async_scheduling, **kwargs)
        assert engine.async_scheduling == async_scheduling
        for i, prompt in enumerate(prompts()):
            engine.add_request(str(i), prompt, params)
        got = {}
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.num_preemptions_total > 0
        engine.step()  # the runner drops the last finished requests' state
        kv = engine.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
        return [got[str(i)] for i in range(len(prompts()))]

    expected = tokens(False)
    assert not leads  # the synchronous engine never asks
    assert tokens(True) == expected
    assert True in leads and False in leads  # both kinds of step ran: read at once, and left in flight
