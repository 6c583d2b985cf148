"""Speculative decoding on the scheduler's side, on ints alone: drafts scheduled as 1 + k tokens
with KV room reserved, the rollback of rejected drafts, stops inside a verify step, the prefix
cache never holding a rejected token, preemption and abort with a verify step in flight, the
n-gram drafter and the configuration's refusals."""

import pytest

from metrale.config.engine_args import EngineArgs
from metrale.config.errors import OptionError
from metrale.config.speculative_config import SpeculativeConfig
from metrale.engine.ngram_drafter import NgramDrafter
from metrale.engine.request import Request, RequestStatus
from metrale.engine.scheduler import Scheduler
from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import ModelRunnerOutput, SchedulerOutput

REPEAT = [5, 6, 7, 8] * 4  # its drafts are [5, 6, 7]: the tokens that followed the last "8" earlier


def make_scheduler(k=3, **kw):
    args = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
                drafter=NgramDrafter(k, 1, 3))
    args.update(kw)
    return Scheduler(**args)


def make_request(rid, prompt, max_tokens=16, **params):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), seed=0)


def step(s: Scheduler, answer):
    """One step; `answer(request_id, drafts) -> (num_accepted, token)` plays the verifier."""
    plan, _ = s.schedule()
    result = ModelRunnerOutput()
    for rid in plan.num_scheduled_tokens:
        request = s.requests[rid]
        if not request.num_pending:
            continue
        drafts = plan.draft_token_ids.get(rid, [])
        num_accepted, token = answer(rid, drafts)
        result.sampled_token_ids[rid] = token
        if drafts:
            result.num_accepted_drafts[rid] = num_accepted
    return plan, s.update(plan, result)


def prefill(s, request):
    s.add_request(request)
    plan, updates = step(s, lambda rid, d: (0, 8))  # the prompt's next token continues the loop: 5
    assert plan.num_scheduled_tokens == {request.request_id: request.num_prompt_tokens}
    return updates


def test_drafts_are_scheduled_with_their_kv_room_and_rolled_back():
    s = make_scheduler()
    r = make_request("a", REPEAT[:-1])  # ends in 7; the prefill samples 8
    prefill(s, r)
    assert r.token_ids[-1] == 8 and r.num_computed_tokens == 15
    plan, updates = step(s, lambda rid, d: (1, 99))  # accepts 5, rejects 6 and 7, then samples 99
    assert plan.draft_token_ids == {"a": [5, 6, 7]}
    assert plan.num_scheduled_tokens == {"a": 4}
    assert len(s.kv.get_block_table("a")) * 4 >= 16 + 3  # room for every draft
    assert updates == [(r, [5, 99])]
    assert r.token_ids[-3:] == [8, 5, 99] and r.num_pending == 0
    # The rejected drafts' positions are not computed: the next step computes from 99 on.
    assert r.num_computed_tokens == r.num_tokens - 1 == 17
    assert s.spec_stats.num_drafts == 1 and s.spec_stats.num_draft_tokens == 3
    assert s.spec_stats.num_accepted_tokens == 1 and s.spec_stats.accepted_per_position == [1, 0, 0]


def test_all_accepted_gives_k_plus_one_tokens():
    s = make_scheduler()
    r = make_request("a", REPEAT[:-1])
    prefill(s, r)
    _, updates = step(s, lambda rid, d: (len(d), 8))
    assert updates == [(r, [5, 6, 7, 8])]
    assert r.num_computed_tokens == r.num_tokens - 1
    assert s.spec_stats.mean_accepted_length == 4.0


def test_drafts_fit_max_tokens_and_the_budget():
    s = make_scheduler(k=8, max_num_batched_tokens=20)
    r = make_request("a", REPEAT[:-1], max_tokens=3)
    prefill(s, r)  # one output token; two more allowed: at most one draft and its bonus token
    plan, updates = step(s, lambda rid, d: (len(d), 42))
    assert plan.draft_token_ids == {"a": [5]}
    assert updates == [(r, [5, 42])] and r.status == RequestStatus.FINISHED_LENGTH
    s2 = make_scheduler(k=8, max_num_batched_tokens=3)
    r2 = make_request("b", REPEAT[:-1] * 1)
    s2.add_request(r2)
    while r2.num_computed_tokens < r2.num_prompt_tokens:
        step(s2, lambda rid, d: (0, 8))
    plan, _ = step(s2, lambda rid, d: (0, 1))
    assert plan.num_scheduled_tokens == {"b": 3} and len(plan.draft_token_ids["b"]) == 2


def test_a_stop_inside_the_verify_step_drops_the_tokens_after_it():
    s = make_scheduler()
    r = Request("a", REPEAT[:-1], SamplingParams(max_tokens=16, stop_token_ids=[6]), seed=0)
    prefill(s, r)
    _, updates = step(s, lambda rid, d: (len(d), 8))  # drafts 5, 6, 7 accepted; 6 stops it
    assert updates == [(r, [5, 6])]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [8, 5, 6]
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_rejected_tokens_never_reach_the_prefix_cache():
    s = make_scheduler(enable_prefix_caching=True)
    r = make_request("a", REPEAT[:-1], max_tokens=6)
    prefill(s, r)  # 16 known tokens: 4 full blocks
    step(s, lambda rid, d: (0, 50))  # every draft rejected: position 16 holds 50, not the draft 5
    assert r.token_ids[16] == 50
    while s.has_unfinished:
        step(s, lambda rid, d: (0, 50))
    # A new request with the draft continuation must not hit block 4 ([5, 6, 7, 8] after the prompt).
    probe = make_request("b", REPEAT[:-1] + [8, 5, 6, 7, 8, 1])
    hit = s.kv.lookup(probe)
    assert hit.num_tokens == 16
    same = make_request("c", r.token_ids[:20] + [1])
    assert s.kv.lookup(same).num_tokens == 20  # the accepted continuation is cached


def test_no_drafts_without_a_match_and_drafts_with_logprobs_or_under_a_grammar():
    from metrale.messages.structured_outputs import StructuredOutputsParams

    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request("a", [1, 2, 3, 4]))  # samples 9: no earlier 9 to follow
    s.add_request(make_request("b", REPEAT[:-1], logprobs=2))  # drafted: each token gets its logprobs
    s.add_request(Request("c", REPEAT[:-1], SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(
        regex="[0-9]+")), seed=0))  # drafted: the runner masks its rows over the drafts
    plan, _ = step(s, lambda rid, d: (0, 9 if rid == "a" else 8))
    assert plan.num_scheduled_tokens == {"a": 4, "b": 15, "c": 15}
    plan, _ = step(s, lambda rid, d: (0, 10))
    assert plan.draft_token_ids == {"b": [5, 6, 7], "c": [5, 6, 7]}
    assert plan.num_scheduled_tokens == {"a": 1, "b": 4, "c": 4}


def test_preemption_with_drafts_recomputes_only_accepted_tokens():
    s = make_scheduler(num_kv_blocks=9, max_num_batched_tokens=64)
    r = make_request("a", REPEAT[:-1], max_tokens=40)
    prefill(s, r)
    other = make_request("b", list(range(100, 115)), max_tokens=40)
    s.add_request(other)
    for _ in range(30):
        if not s.has_unfinished:
            break
        step(s, lambda rid, d: (len(d) // 2, 8))
    assert s.num_preemptions_total > 0
    assert r.num_pending == 0 and not r.drafts_in_flight
    while s.has_unfinished:
        step(s, lambda rid, d: (len(d) // 2, 8))
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_abort_with_a_verify_step_in_flight():
    s = make_scheduler()
    r = make_request("a", REPEAT[:-1])
    prefill(s, r)
    plan, _ = s.schedule()
    assert plan.draft_token_ids["a"]
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.update(plan, ModelRunnerOutput({"a": 1}, num_accepted_drafts={"a": 2})) == []
    assert s.spec_stats.num_drafts == 0  # never verified for anyone
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_request_waits_for_its_verify_step():
    s = make_scheduler()
    r = make_request("a", REPEAT[:-1])
    prefill(s, r)
    first, _ = s.schedule()
    second, _ = s.schedule()  # asynchronous scheduling: the verify step has not been read
    assert "a" in first.num_scheduled_tokens and "a" not in second.num_scheduled_tokens


def test_plan_with_drafts_crosses_the_wire():
    plan = SchedulerOutput(num_scheduled_tokens={"a": 3}, draft_token_ids={"a": [4, 5]})
    assert SchedulerOutput.from_wire(plan.to_wire()) == plan


def test_verify_steps_of_models_with_state_save_no_checkpoint():
    # A verify step's state includes its drafts until the runner keeps the accepted one's: a
    # drafted request's step never carries a state save, its prefill chunks still do.
    s = make_scheduler(num_state_slots=8, num_checkpoint_slots=4, enable_prefix_caching=True)
    r = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])  # then 3: "1 2 3" again, drafts 4 5 6
    s.add_request(r)
    saves = []
    for _ in range(4):
        plan, _ = s.schedule()
        saves.append(plan.state_saves)
        if plan.draft_token_ids:
            break
        s.update(plan, ModelRunnerOutput(sampled_token_ids={"a": 3} if r.num_pending else {}))
    assert plan.draft_token_ids["a"] and any(saves[:-1]) and not saves[-1]


def test_ngram_drafter():
    drafter = NgramDrafter(3, 2, 4)
    assert drafter.propose([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]  # the 3-gram 1 2 3 matched
    assert drafter.propose([1, 2, 3, 9, 7, 2, 3, 5, 2, 3]) == [5, 2, 3]  # the latest match wins
    assert drafter.propose([1, 2, 3, 4, 5]) == []  # no repeated n-gram of at least 2
    assert drafter.propose([1, 2, 1, 2], max_tokens=1) == [1]
    assert NgramDrafter(3, 1, 1).propose([4, 4]) == [4]


@pytest.mark.parametrize("value, message", [
    ("{not json", "JSON object"),
    ({"method": "dflash", "num_speculative_tokens": 2}, "'dflash' needs model"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not built yet"),
    ({"method": "nope", "num_speculative_tokens": 2}, "must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "above"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
])
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(OptionError, match=message):
        EngineArgs.from_kwargs(speculative_config=value)


def test_speculative_config_from_the_command_line_and_num_drafts():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 4}', "--num-drafts", "5"]))
    assert args.speculative_decoding == SpeculativeConfig("ngram", 5, 4, 4)
    # --speculative: the model's MTP layers, one draft unless --num-drafts says otherwise.
    assert EngineArgs.from_kwargs(speculative=True).speculative_decoding.method == "mtp"
    assert EngineArgs.from_kwargs(speculative=True).speculative_decoding.num_speculative_tokens == 1
    assert EngineArgs.from_kwargs(speculative=True, num_drafts=2).speculative_decoding.num_speculative_tokens == 2
    with pytest.raises(OptionError, match="do not give --speculative-config too"):
        EngineArgs.from_kwargs(speculative=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(OptionError, match="no drafter is configured"):
        EngineArgs.from_kwargs(num_drafts=3)


# -- asynchronous scheduling with a drafter in the runner (drafts_on_device) -----------------------

def make_device_scheduler(k=2, lookahead=1, **kw):
    from metrale.engine.runner_drafts import RunnerDrafts

    s = make_scheduler(drafter=RunnerDrafts(k, lookahead), **kw)
    s.drafts_on_device = True
    return s


def answer(plan, tokens: dict, accepted: dict = {}, accepted_ids: dict = {}, proposals: dict = {}) -> ModelRunnerOutput:
    """The runner's result of `plan`: a token per request that samples, drafts accepted per request,
    the drafter's proposals for the next step."""
    return ModelRunnerOutput({rid: t for rid, t in tokens.items() if rid in plan.num_scheduled_tokens},
                             num_accepted_drafts=dict(accepted), accepted_draft_ids=dict(accepted_ids),
                             draft_token_ids=dict(proposals))


def test_a_greedy_request_is_planned_over_its_verify_step_in_flight():
    from metrale.messages.scheduler_output import PLACEHOLDER

    s = make_device_scheduler()
    r = make_request("a", list(range(1, 11)), max_tokens=30, temperature=0)
    s.add_request(r)
    prefill, _ = s.schedule()  # 10 prompt tokens; samples one (in flight)
    first, _ = s.schedule()  # over it: that token, then the 2 drafts its drafter proposes on the device
    assert first.num_scheduled_tokens == {"a": 3} and first.draft_token_ids == {"a": [PLACEHOLDER] * 2}
    assert first.cached_requests[0].num_unverified_drafts == 0  # the prefill verified nothing
    s.update(prefill, answer(prefill, {"a": 50}, proposals={"a": [60, 62]}))
    assert r.token_ids[10:] == [50, PLACEHOLDER] and r.num_computed_tokens == 13
    assert r.inflight_drafts[0] == [60, 62]  # the first step's drafts, known on the host from now on
    second, _ = s.schedule()  # over the first verify step, as if it accepts both drafts
    assert second.cached_requests[0].num_unverified_drafts == 2
    assert second.cached_requests[0].num_computed_tokens == 13 and second.num_scheduled_tokens == {"a": 3}
    # Room was reserved up to the last position the second step may reach, and the lookahead.
    assert len(s.kv.get_block_table("a")) * 4 >= 16 + 1
    s.update(first, answer(first, {"a": 61}, {"a": 1}, {"a": [60]}, {"a": [70, 71]}))  # one accepted, one rejected
    assert r.token_ids[10:] == [50, 60, 61, PLACEHOLDER]
    # The count rolled back by the rejected draft: the second step's rows start at 61 (position 12).
    assert r.num_computed_tokens - r.num_unverified_drafts == r.num_tokens - 1 == 13
    s.update(second, answer(second, {"a": 72}, {"a": 2}, {"a": [70, 71]}))
    assert r.output_token_ids == [50, 60, 61, 70, 71, 72]
    assert r.num_computed_tokens == r.num_tokens - 1 and not r.inflight_drafts
    assert s.spec_stats.num_drafts == 2 and s.spec_stats.num_accepted_tokens == 3


@pytest.mark.parametrize("params, planned_over", [
    (dict(temperature=0.7, top_p=0.9), True),  # its stream's output index: corrected on the device
    (dict(temperature=0, repetition_penalty=1.2), False),  # penalties read the tokens
    (dict(temperature=0, min_tokens=10), False),  # min_tokens counts the outputs
])
def test_which_requests_are_planned_over_their_verify_step(params, planned_over):
    s = make_device_scheduler()
    r = make_request("a", list(range(1, 11)), **params)
    s.add_request(r)
    prefill, _ = s.schedule()
    s.update(prefill, answer(prefill, {"a": 50}))
    r.runner_drafts = [5, 6]  # what the runner's drafter proposed with the prefill's token
    first, _ = s.schedule()
    assert first.draft_token_ids == {"a": [5, 6]}  # nothing in flight: the host's drafts
    second, _ = s.schedule()
    assert ("a" in second.num_scheduled_tokens) == planned_over


def test_a_stop_in_a_verify_step_drops_the_step_planned_after_it():
    s = make_device_scheduler()
    r = Request("a", list(range(1, 11)), SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[60]), seed=0)
    s.add_request(r)
    prefill, _ = s.schedule()
    first, _ = s.schedule()
    s.update(prefill, answer(prefill, {"a": 50}))
    second, _ = s.schedule()
    updates = s.update(first, answer(first, {"a": 62}, {"a": 2}, {"a": [60, 61]}))  # 60 stops it
    assert updates == [(r, [60])]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [50, 60]
    assert s.update(second, answer(second, {"a": 70}, {"a": 1}, {"a": [63]})) == []
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_no_device_drafts_where_the_lookahead_found_no_room():
    s = make_device_scheduler(k=3, lookahead=2, num_kv_blocks=4)  # 16 tokens of KV in all
    r = make_request("a", list(range(1, 13)), max_tokens=30, temperature=0)
    s.add_request(r)
    s.schedule()  # 12 tokens in 3 blocks; the drafter's lookahead writes up to position 13: granted
    assert r.device_drafts_ready == 3
    first, _ = s.schedule()  # its token and 3 drafts at positions 12..15: the 4th block
    assert len(first.draft_token_ids["a"]) == 3
    # Its drafter would write positions 16 and 17 past them: no fifth block, so drafts it may
    # leave short, and none are planned over it.
    assert r.device_drafts_ready == 0
    second, _ = s.schedule()
    assert "a" not in second.draft_token_ids


def test_max_tokens_counts_the_drafts_in_flight_as_accepted():
    s = make_device_scheduler(k=3, lookahead=0)
    r = make_request("a", list(range(1, 11)), max_tokens=6, temperature=0)
    s.add_request(r)
    prefill, _ = s.schedule()
    first, _ = s.schedule()  # 1 output pending: room for 3 drafts and the bonus (5 outputs at most)
    assert len(first.draft_token_ids["a"]) == 3
    second, _ = s.schedule()  # if all 3 are accepted, 5 outputs: one more token, no draft
    assert "a" in second.num_scheduled_tokens and "a" not in second.draft_token_ids


def test_no_device_drafts_after_the_drafter_proposed_none_and_padding_is_no_draft():
    """Prompt lookup in the runner proposes nothing where it finds no match: the request's next
    step over the one in flight is a plain row, and drafts the device padded (-1, verified all the
    same) are not counted as drafts."""
    from metrale.messages.scheduler_output import PLACEHOLDER

    s = make_device_scheduler(k=3, lookahead=0)
    r = make_request("a", list(range(1, 11)), max_tokens=30, temperature=0)
    s.add_request(r)
    prefill, _ = s.schedule()
    first, _ = s.schedule()  # nothing read yet: drafts are planned
    assert first.draft_token_ids == {"a": [PLACEHOLDER] * 3}
    s.update(prefill, answer(prefill, {"a": 50}, proposals={"a": [7]}))  # a match of one token
    assert r.inflight_drafts[0] == [7, PLACEHOLDER, PLACEHOLDER]
    second, _ = s.schedule()
    assert len(second.draft_token_ids["a"]) == 3
    s.update(first, answer(first, {"a": 8}, {"a": 1}, {"a": [7]}, proposals={"a": []}))  # then no match
    assert s.spec_stats.num_drafts == 1 and s.spec_stats.num_draft_tokens == 1  # the one proposed draft
    assert s.spec_stats.num_accepted_tokens == 1
    third, _ = s.schedule()
    assert "a" in third.num_scheduled_tokens and "a" not in third.draft_token_ids  # a plain row
    s.update(second, answer(second, {"a": 9}, {"a": 0}, {"a": []}, proposals={"a": [1, 2, 3]}))
    assert s.spec_stats.num_drafts == 1  # its drafts were padding: none counted
    s.update(third, answer(third, {"a": 4}, proposals={"a": [1, 2, 3]}))
    fourth, _ = s.schedule()
    assert fourth.draft_token_ids == {"a": [1, 2, 3]}  # nothing in flight: the host's copy of the proposal
