"""Speculative decoding under asynchronous scheduling (engine/scheduler.py, executor/last_step.py):
with a drafter in the runner (MTP, DFlash), step N+1 is planned and launched while step N, a verify
step, is in flight. A greedy request is planned over it with the drafts step N's drafter left on
the device, its rows laid out as if step N accepted every draft, and moved back on the device by
the drafts it rejected; step N's result rolls the host's count back by as many.

- Lossless: greedy tokens equal transformers' and the synchronous engine's (k = 1, 2, 3; dense and
  hybrid targets, MTP and DFlash drafters), with steps really planned over drafts in flight
  (counted) and drafts accepted (a passthrough MTP layer); under chunked prefill with forced
  preemption, prefix hits and tp=2.
- Requests that sample, edit their logits or ask for logprobs: the same outputs as the synchronous
  engine (the sampled and penalized ones read the step before their next plan).
- Stops inside a verify step with the next step already planned, and aborts: outputs end where
  plain decoding ends, and every block and state slot is free at idle.
"""

from __future__ import annotations

import pytest

from checkpoints import make_checkpoint
from hybrid_checkpoints import SPEC_INITIALIZER_RANGE, make_hybrid_checkpoint
from metrale import LLM, SamplingParams
from qwen_mtp_checkpoints import (DENSE, LAYERS, MTP_GREEDY, assert_drafted_and_idle, greedy, mtp_checkpoint_cache,
                                  mtp_engine)
from hybrid_checkpoints import spec_prompts


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A passthrough MTP layer (it drafts the target's last token again): drafts are accepted
    where the target repeats itself."""
    return mtp_checkpoint_cache(tmp_path_factory, "async_mtp", lambda path, family: make_checkpoint(
        path, family, num_hidden_layers=2, initializer_range=SPEC_INITIALIZER_RANGE), passthrough=True, **DENSE)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return mtp_checkpoint_cache(tmp_path_factory, "async_mtp_hybrid", lambda path, family: make_hybrid_checkpoint(
        path, family, num_hidden_layers=LAYERS, initializer_range=SPEC_INITIALIZER_RANGE), passthrough=True)


def count_overlapped_plans(llm: LLM) -> list[int]:
    """Counts, in a one-element list, the requests planned while their verify step was in flight."""
    scheduler, counted = llm.llm_engine.scheduler, [0]
    schedule = scheduler.schedule

    def counting():
        plan, ended = schedule()
        counted[0] += sum(1 for c in plan.cached_requests if c.num_unverified_drafts)
        return plan, ended

    scheduler.schedule = counting
    return counted


def async_engine(path: str, k: int, **kwargs) -> LLM:
    llm = mtp_engine(path, k, async_scheduling=True, **kwargs)
    assert llm.llm_engine.async_scheduling and llm.llm_engine.scheduler.drafts_on_device
    return llm


@pytest.mark.parametrize("family, k", [("qwen3", 1), ("llama", 2), ("qwen3", 3)])
def test_greedy_equals_transformers_with_steps_planned_over_drafts(dense, family, k):
    _, path, _, expected = dense(family)
    llm = async_engine(path, k)
    overlapped = count_overlapped_plans(llm)
    assert greedy(llm) == expected
    assert overlapped[0] > 0
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_drafted_and_idle(llm)


def test_chunked_prefill_and_preemption(dense):
    _, path, _, expected = dense("qwen3")
    llm = async_engine(path, 2, max_num_batched_tokens=12, num_kv_blocks=24, block_size=4)
    overlapped = count_overlapped_plans(llm)
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert overlapped[0] > 0
    assert_drafted_and_idle(llm)


def test_prefix_hits(dense):
    _, path, _, expected = dense("llama")
    llm = async_engine(path, 3, block_size=4)
    assert greedy(llm) == expected
    overlapped = count_overlapped_plans(llm)
    assert greedy(llm) == expected  # again: the prompts' blocks are cached now
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > 0
    assert overlapped[0] > 0
    assert_drafted_and_idle(llm)


def test_hybrid_target_keeps_the_state_of_the_last_accepted_draft(hybrid):
    _, path, _, expected = hybrid("qwen3_next")
    llm = async_engine(path, 2)
    overlapped = count_overlapped_plans(llm)
    assert greedy(llm) == expected
    assert overlapped[0] > 0
    assert_drafted_and_idle(llm)


def test_hybrid_target_chunked_preempted_and_resumed_from_checkpoints(hybrid):
    """No state checkpoint is saved while a request's count assumes drafts in flight accepted;
    prefix hits resume from the checkpoints its prefill saved."""
    _, path, _, expected = hybrid("qwen3_next")
    llm = async_engine(path, 2, max_num_batched_tokens=12, num_kv_blocks=20, block_size=4)
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_drafted_and_idle(llm)
    llm = async_engine(path, 2, block_size=4)
    assert greedy(llm) == expected
    overlapped = count_overlapped_plans(llm)
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > 0 and overlapped[0] > 0
    assert_drafted_and_idle(llm)


def _outputs(llm: LLM, params: list[SamplingParams]):
    """Per request, per completion: tokens, finish reason, and each token's top logprobs rounded
    (a row's float32 rounding depends on the shape of the step it ran in)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in spec_prompts()[:len(params)]], params, use_tqdm=False)
    return [[(o.token_ids, o.finish_reason,
              [[(t, lp.rank, round(lp.logprob, 4)) for t, lp in sorted(top.items())] for top in o.logprobs]
              if o.logprobs else None) for o in r.outputs] for r in outs]


def test_greedy_requests_with_logprobs_are_planned_over_drafts(dense):
    _, path, _, _ = dense("llama")
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True), MTP_GREEDY] * 3
    expected = _outputs(mtp_engine(path, 2), params)
    llm = async_engine(path, 2)
    overlapped = count_overlapped_plans(llm)
    assert _outputs(llm, params) == expected
    assert overlapped[0] > 0
    assert_drafted_and_idle(llm)


def test_sampled_requests_are_planned_over_drafts_with_their_own_streams(dense):
    """A request drawn at random keys its streams by its output index, which the device
    corrects by the drafts the step in flight accepted (the keys themselves:
    tests/executor/test_rejection_sampler.py): seeded requests give the same tokens alone and
    batched, n = 2 included. (Not the synchronous engine's: near max_tokens, and after a step
    whose drafts the host had not read, a step verifies another number of drafts, and a
    position verified as a draft draws otherwise than one sampled plainly.)"""
    _, path, _, _ = dense("llama")
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.5, top_k=20, min_p=0.05, seed=11, max_tokens=12, ignore_eos=True),
              MTP_GREEDY]
    llm = async_engine(path, 2)
    overlapped = count_overlapped_plans(llm)
    batched = _outputs(llm, params)
    assert overlapped[0] > 0
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    prompts = spec_prompts()
    alone = [_outputs_of(llm, [prompts[i]], [p])[0] for i, p in enumerate(params)]
    assert alone == batched
    assert_drafted_and_idle(llm)


def _outputs_of(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(o.token_ids, o.finish_reason, None) for o in r.outputs] for r in outs]


def test_edited_requests_read_the_step_before(dense):
    """Penalties read the tokens and min_tokens counts them, which a verify step in flight leaves
    unknown: the engine reads such a step before planning the next."""
    _, path, _, _ = dense("llama")
    params = [
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=12, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logit_bias={7: 2.0}, ignore_eos=True),
        MTP_GREEDY,
    ]
    expected = _outputs(mtp_engine(path, 2), params)
    llm = async_engine(path, 2)
    assert _outputs(llm, params) == expected
    assert_drafted_and_idle(llm)


def test_a_stop_inside_a_verify_step_ends_where_plain_decoding_ends(dense):
    """A stop token accepted among a verify step's drafts, with the request's next step planned
    already: the tokens after it are dropped, and so is that step."""
    _, path, _, expected = dense("qwen3")
    plain = LLM(path, dtype="float32", device="cpu")
    llm = async_engine(path, 3)
    prompts = [{"prompt_token_ids": p} for p in spec_prompts()]
    for tokens in expected:
        params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[5]], ignore_eos=True)
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert_drafted_and_idle(llm)


def test_aborts_free_everything(dense):
    _, path, _, expected = dense("llama")
    llm = async_engine(path, 2)
    engine = llm.llm_engine
    for i, prompt in enumerate(spec_prompts()):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, MTP_GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.scheduler.spec_stats.num_drafts > 0
    for i in range(0, len(spec_prompts()), 2):
        engine.abort_request(str(i))
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert greedy(llm) == expected  # and the engine serves on


def test_dflash_drafter(tmp_path):
    from checkpoints import load_reference, reference_greedy
    from dflash_checkpoints import make_dflash_drafter, make_dflash_target

    target = make_dflash_target(str(tmp_path / "target"), "qwen3")
    drafter = make_dflash_drafter(str(tmp_path / "drafter"), target)
    model = load_reference(target)
    expected = [reference_greedy(model, p, 12) for p in spec_prompts()]
    llm = LLM(target, dtype="float32", device="cpu", async_scheduling=True,
              speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": 3})
    assert llm.llm_engine.scheduler.drafts_on_device
    overlapped = count_overlapped_plans(llm)
    assert greedy(llm) == expected
    assert overlapped[0] > 0
    assert_drafted_and_idle(llm)


def test_tensor_parallel_two_ranks(dense):
    _, path, _, expected = dense("qwen3")
    llm = async_engine(path, 2, tp_size=2)
    try:
        overlapped = count_overlapped_plans(llm)
        assert greedy(llm) == expected
        assert overlapped[0] > 0
        assert_drafted_and_idle(llm)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def ngram_case(tmp_path_factory):
    """A Llama checkpoint, prompts two of which prompt lookup drafts well, transformers' tokens."""
    from checkpoints import load_reference, reference_greedy
    from speculative_cases import NEW_TOKENS, make_prompts

    path = make_checkpoint(str(tmp_path_factory.mktemp("async_ngram")), "llama")
    model = load_reference(path)
    return path, [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]


def ngram_engine(path: str, asynchronous: bool, **kwargs) -> LLM:
    from speculative_cases import SPEC

    return LLM(path, dtype="float32", device="cpu", speculative_config=SPEC, async_scheduling=asynchronous, **kwargs)


def ngram_greedy(llm: LLM) -> list[list[int]]:
    from speculative_cases import GREEDY, make_prompts

    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in make_prompts()], GREEDY,
                                                          use_tqdm=False)]


def test_ngram_drafts_in_the_runner_under_asynchronous_scheduling(ngram_case):
    """Prompt lookup moves into the runner (executor/drafters/ngram.py): the host's drafts for the
    same tokens, the same tokens; drafts accepted. (Not the same count: a step is planned over
    the one in flight before that step's proposal is read, so a match is drafted a step later.)"""
    from metrale.executor.drafters.ngram import NgramRunnerDrafter

    path, expected = ngram_case
    synchronous = ngram_engine(path, False)
    assert synchronous.llm_engine.runner.drafter is None  # the scheduler's own
    assert ngram_greedy(synchronous) == expected
    llm = ngram_engine(path, True, max_num_seqs=4)  # 4 history rows, given back as requests end
    assert isinstance(llm.llm_engine.runner.drafter, NgramRunnerDrafter) and llm.llm_engine.async_scheduling
    overlapped = count_overlapped_plans(llm)
    assert ngram_greedy(llm) == expected
    assert overlapped[0] > 0
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert synchronous.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert ngram_greedy(llm) == expected
    assert_drafted_and_idle(llm)


def test_ngram_in_the_runner_chunked_preempted_and_prefix_hits(ngram_case):
    path, expected = ngram_case
    llm = ngram_engine(path, True, max_num_batched_tokens=16, num_kv_blocks=40, block_size=4)
    assert ngram_greedy(llm) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    llm = ngram_engine(path, True, block_size=4)
    assert ngram_greedy(llm) == expected
    assert ngram_greedy(llm) == expected  # the prompts' blocks cached: the drafter's history from the hit on
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > 0
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_drafted_and_idle(llm)


def test_ngram_history_rows_follow_the_runners_requests():
    """A row per request the runner holds: taken when it first sees one (again after a
    preemption), given back when it drops it, also when startup's warm-up steps are forgotten."""
    import torch

    from metrale.executor.drafters.ngram import NgramRunnerDrafter

    drafter = NgramRunnerDrafter(2, 1, 3, max_model_len=16)
    drafter.allocate(2, torch.device("cpu"))
    drafter.admit("a", [5, 6, 7])
    drafter.admit("a", [5, 6, 7, 8])  # resumed: the same request, one row
    drafter.admit("b", [1, 2, -1])  # a pending token (-1) is written by the step that computes it
    assert sorted(drafter.rows) == ["a", "b"] and drafter.history[drafter.rows["a"], :4].tolist() == [5, 6, 7, 8]
    with pytest.raises(RuntimeError, match="more running requests than max_num_seqs"):
        drafter.admit("c", [1])
    drafter.forget("a")
    drafter.admit("c", [1])
    assert sorted(drafter.rows) == ["b", "c"]


def test_startup_steps_leave_no_history_rows(ngram_case):
    path, _ = ngram_case
    llm = ngram_engine(path, True, max_num_seqs=2)
    runner = llm.llm_engine.runner
    from metrale.executor.startup_passes import forward_whole, prefill_plan

    forward_whole(runner, prefill_plan(runner, [[1, 2, 3], [4, 5]], "__warmup"))
    assert len(runner.drafter.rows) == 2
    runner.drop_requests()
    assert not runner.drafter.rows and not runner.requests
    assert ngram_greedy(llm)  # both rows free for the requests


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_soak_with_aborts_and_preemption_leaves_nothing_behind(dense, drafter):
    """Random requests (n up to 3, greedy and sampled, stop strings), random aborts, a small pool
    that preempts, drafts planned over steps in flight: every block, every runner request and
    every n-gram history row free at idle, no hang."""
    import importlib.util
    import os

    from metrale.config.engine_args import EngineArgs
    from metrale.startup import build_llm_engine

    spec = importlib.util.spec_from_file_location(
        "engine_soak", os.path.join(os.path.dirname(__file__), "..", "engine", "test_soak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, path, _, _ = dense("llama")
    speculative = {"method": "mtp", "num_speculative_tokens": 2} if drafter == "mtp" else \
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = build_llm_engine(EngineArgs(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=8,
                                         max_num_batched_tokens=64, async_scheduling=True,
                                         speculative_config=speculative))
    assert engine.scheduler.drafts_on_device
    counts = module.soak(engine, steps=60, seed=3)
    assert counts["added"] == counts["aborted"] + counts["finished"]
    assert engine.scheduler.spec_stats.num_drafts > 0
    if drafter == "ngram":
        assert not engine.runner.drafter.rows
