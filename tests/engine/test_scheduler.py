"""The scheduler on ints alone: budgets, chunking, preemption, and blocks back after every end."""

import pytest

from metrale.engine.request import Request, RequestStatus
from metrale.messages.sampling_params import SamplingParams
from metrale.engine.scheduler import Scheduler
from metrale.messages.scheduler_output import ModelRunnerOutput, SchedulerOutput


def make_scheduler(**kw):
    args = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    args.update(kw)
    return Scheduler(**args)


def make_request(rid, prompt_len, max_tokens=4, **params):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **params), seed=0)


def run_step(s: Scheduler, token=7):
    plan, ended = s.schedule()
    # A chunk that reaches the end of its sequence samples: the scheduler holds a placeholder for it.
    sampled = {rid: token for rid in plan.num_scheduled_tokens if s.requests[rid].num_pending}
    s.update(plan, ModelRunnerOutput(sampled_token_ids=sampled))
    return plan, ended


def run_to_end(s, limit=500):
    plans = []
    for _ in range(limit):
        if not s.has_unfinished:
            return plans
        plans.append(run_step(s)[0])
    raise AssertionError("scheduler did not finish: a hang")


def test_budget_chunks_prefill_and_admits_fcfs():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request("a", 25))
    s.add_request(make_request("b", 3))
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"a": 10}
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"a": 10}
    plan, _ = run_step(s)
    # a's last 5 prompt tokens, then b takes the rest of the budget
    assert plan.num_scheduled_tokens == {"a": 5, "b": 3}
    assert [r.request_id for r in plan.new_requests] == ["b"]
    plan, _ = run_step(s)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}  # both decoding


def test_new_requests_sent_once_then_as_diffs():
    s = make_scheduler()
    s.add_request(make_request("a", 6))
    plan, _ = run_step(s)
    assert [r.request_id for r in plan.new_requests] == ["a"] and not plan.cached_requests
    plan, _ = run_step(s)
    assert not plan.new_requests and [c.request_id for c in plan.cached_requests] == ["a"]


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(str(i), 2))
    plan, _ = run_step(s)
    assert set(plan.num_scheduled_tokens) == {"0", "1"}


def test_finish_returns_blocks_and_tells_runner():
    s = make_scheduler()
    for i in range(5):
        s.add_request(make_request(str(i), 7 + i, max_tokens=3))
    plans = run_to_end(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.requests
    plans.append(s.schedule()[0])
    told = [rid for plan in plans for rid in plan.finished_request_ids]
    assert sorted(told) == [str(i) for i in range(5)]


def test_abort_running_and_waiting_returns_blocks():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 9, max_tokens=50))
    s.add_request(make_request("b", 9, max_tokens=50))
    run_step(s)
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is None
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.has_unfinished


def test_preempts_newest_and_recomputes():
    # 6 blocks of 4 = 24 tokens; three requests of 6 prompt tokens growing to 12 cannot all fit.
    s = make_scheduler(num_kv_blocks=6, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(make_request(str(i), 6, max_tokens=6))
    victims = []
    for _ in range(200):
        if not s.has_unfinished:
            break
        before = {r.request_id for r in s.running}
        run_step(s)
        victims += [r.request_id for r in s.waiting if r.request_id in before]
    assert not s.has_unfinished
    assert s.num_preemptions_total > 0
    assert victims[0] == "2"  # the newest goes first
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_preempted_request_resent_whole():
    s = make_scheduler(num_kv_blocks=4, max_num_batched_tokens=64)
    s.add_request(make_request("a", 7, max_tokens=20))
    s.add_request(make_request("b", 7, max_tokens=20))
    seen_new = []
    for _ in range(100):
        if not s.has_unfinished:
            break
        plan, _ = run_step(s)
        seen_new += [(r.request_id, r.num_computed_tokens, len(r.token_ids)) for r in plan.new_requests]
    resumed = [x for x in seen_new if x[0] == "b"][1:]
    assert resumed and all(computed == 0 and length > 7 for _, computed, length in resumed)


def test_request_that_can_never_fit_ends_without_hang():
    s = make_scheduler(num_kv_blocks=2, max_num_batched_tokens=64)  # 8 tokens of KV in all
    with pytest.raises(ValueError, match="KV cache holds only 8"):
        s.add_request(make_request("huge", 9))
    s.add_request(make_request("grows", 6, max_tokens=10))
    run_to_end(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_request_that_outgrows_pool_ends_with_length():
    s = make_scheduler(num_kv_blocks=2, max_num_batched_tokens=64)
    req = make_request("grows", 6, max_tokens=10)
    s.add_request(req)
    run_to_end(s)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.num_tokens == 9  # 8 slots computed + the last sampled token


def test_stops_on_eos_after_min_tokens_and_on_stop_token():
    s = make_scheduler()
    eos = make_request("eos", 3, max_tokens=10, min_tokens=2)
    eos.sampling_params.eos_token_ids = [7]
    stop = make_request("stop", 3, max_tokens=10, stop_token_ids=[7])
    s.add_request(eos)
    s.add_request(stop)
    run_to_end(s)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.num_output_tokens == 2
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.stop_reason == 7 and stop.num_output_tokens == 1


def test_max_model_len_ends_with_length():
    s = make_scheduler(max_model_len=10)
    req = make_request("a", 8, max_tokens=None)
    s.add_request(req)
    run_to_end(s)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 10


def test_plan_roundtrips_through_msgpack():
    import msgpack

    s = make_scheduler()
    s.add_request(make_request("a", 5, temperature=0.5, stop=["x"]))
    plan, _ = s.schedule()
    wire = msgpack.unpackb(msgpack.packb(plan.to_wire()), strict_map_key=False)
    assert SchedulerOutput.from_wire(wire) == plan
