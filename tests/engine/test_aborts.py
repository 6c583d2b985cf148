"""Abort latency (issue 22): an abort frees its blocks when it is applied, at the next step
boundary, even with a step in flight (asynchronous scheduling); no later plan schedules the
request; the AsyncEngine publishes the freed blocks before it runs another step; and on the CPU
the default step budget is small, because a step's length is what an abort waits for."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from metrale.config.engine_args import CPU_STEP_TOKEN_BUDGET, CUDA_STEP_TOKEN_BUDGET, EngineArgs
from metrale.engine.async_engine import AsyncEngine, EngineObserver
from metrale.messages.sampling_params import SamplingParams
from metrale.startup import build_llm_engine


def _engine(checkpoint_factory, **kwargs):
    args = dict(model=checkpoint_factory("llama"), device="cpu", num_kv_blocks=64, block_size=4,
                max_num_batched_tokens=32)
    return build_llm_engine(EngineArgs(**{**args, **kwargs}))


def _record_plans(engine) -> list:
    plans = []
    execute_async = engine.executor.execute_async

    def recording(plan):
        plans.append(plan)
        return execute_async(plan)

    engine.executor.execute_async = recording
    return plans


def _mentions(plan, request_ids: set[str]) -> set[str]:
    named = set(plan.num_scheduled_tokens) | {r.request_id for r in plan.new_requests}
    named |= {r.request_id for r in plan.cached_requests}
    return named & request_ids


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_async_abort_frees_blocks_at_once_and_no_later_plan_has_it(checkpoint_factory, prefix_caching):
    engine = _engine(checkpoint_factory, async_scheduling=True, enable_prefix_caching=prefix_caching)
    assert engine.async_scheduling
    plans = _record_plans(engine)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(5, 45))}, params.clone(n=2))  # siblings 0_a, 1_a
    engine.add_request("b", {"prompt_token_ids": list(range(50, 70))}, params)
    children = {"0_a", "1_a"}
    for _ in range(50):  # until both decode, with a step in flight that computes them
        engine.step()
        if (engine._inflight is not None and _mentions(engine._inflight[0], children) == children
                and all(engine.scheduler.requests[c].num_output_tokens > 1 for c in children)):
            break
    else:
        pytest.fail("a's children never decoded with a step in flight")
    kv = engine.scheduler.kv

    engine.abort_request("a")  # the step in flight still computes a's rows
    assert not children & set(engine.scheduler.requests) and not children & set(kv.block_tables)
    assert "a" not in engine.outputs.parents
    assert kv.num_free_blocks == kv.num_blocks - len(kv.block_tables["b"]), "a's blocks are free at once"

    aborted_at = len(plans)
    outputs = engine.step()  # plans the next step and reads back the one in flight
    assert all(out.request_id != "a" for out in outputs)
    assert not _mentions(plans[aborted_at], children)
    assert children <= set(plans[aborted_at].finished_request_ids)  # the runner drops their state
    assert not children & set(engine.runner.requests)
    # The in-flight result took no block back and cached nothing for the aborted rows.
    assert kv.num_free_blocks == kv.num_blocks - len(kv.block_tables["b"])
    while engine.has_unfinished_requests():
        assert all(out.request_id != "a" for out in engine.step())
    assert not any(_mentions(plan, children) for plan in plans[aborted_at:])
    assert kv.num_free_blocks == kv.num_blocks


class _Snapshots(EngineObserver):
    def __init__(self, steps_done: list[int]):
        self.steps_done = steps_done
        self.seen: list[tuple[int, object]] = []  # (steps finished when published, snapshot)

    def on_snapshot(self, snapshot) -> None:
        self.seen.append((self.steps_done[0], snapshot))


def test_freed_blocks_are_published_before_the_next_step_runs(checkpoint_factory):
    """An abort that lands during a (slow) step shows in the snapshot as soon as that step ends,
    although another request keeps the engine stepping."""
    steps_done = [0]
    step_began = threading.Event()
    observer = _Snapshots(steps_done)

    def make_engine():
        engine = _engine(checkpoint_factory, num_kv_blocks=128)
        step = engine.step

        def slow_step():
            step_began.set()
            time.sleep(0.15)  # a long step: the abort below arrives while it runs
            outputs = step()
            steps_done[0] += 1
            return outputs

        engine.step = slow_step
        return engine

    async def run():
        engine = AsyncEngine(make_engine, max_waiting=8, observer=observer)
        engine.start()
        await engine.wait_until_loaded()
        try:
            params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            a = await engine.add_request("a", {"prompt_token_ids": list(range(5, 45))}, params)
            await engine.add_request("b", {"prompt_token_ids": list(range(50, 70))}, params)
            await a.__anext__()  # a is running and has blocks
            step_began.clear()
            await asyncio.to_thread(step_began.wait)
            in_progress, before = steps_done[0] + 1, len(observer.seen)  # the step running now
            assert observer.seen[-1][1].num_running == 2
            a.abort()
            deadline = time.monotonic() + 10
            while not any(s.num_running == 1 for _, s in observer.seen[before:]) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            engine.shutdown()
        return in_progress, before

    in_progress, before = asyncio.run(run())
    published = next(i for i in range(before, len(observer.seen)) if observer.seen[i][1].num_running == 1)
    steps_then, snapshot = observer.seen[published]
    assert steps_then == in_progress, "published after the step the abort waited for, not one later"
    assert snapshot.kv_blocks_free > observer.seen[published - 1][1].kv_blocks_free


def test_the_cpu_step_budget_is_small_by_default(checkpoint_factory):
    args = EngineArgs()
    assert args.max_num_batched_tokens == "auto"
    assert args.step_token_budget("cpu") == CPU_STEP_TOKEN_BUDGET == 512
    assert args.step_token_budget("cuda") == CUDA_STEP_TOKEN_BUDGET == 8192
    assert EngineArgs(max_num_batched_tokens=2048).step_token_budget("cpu") == 2048
    assert EngineArgs(max_num_batched_tokens="100").max_num_batched_tokens == 100  # as the CLI passes it
    engine = build_llm_engine(EngineArgs(model=checkpoint_factory("llama"), device="cpu", num_kv_blocks=64))
    assert engine.scheduler.max_num_batched_tokens == CPU_STEP_TOKEN_BUDGET
