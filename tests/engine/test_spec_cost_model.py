"""The measured cost model of speculative decoding, on ints and floats alone: the k it picks from a
calibration table and the acceptance seen (k = 0 where drafting does not pay, k > 0 at batch 1
where it does), the table's interpolation, its refusals (malformed, another setup), the scheduler
drafting the chosen k per step, and the configuration's refusals."""

import json

import pytest

from metrale.config.engine_args import EngineArgs
from metrale.config.errors import OptionError
from metrale.engine.ngram_drafter import NgramDrafter
from metrale.engine.request import Request, RequestStatus
from metrale.engine.scheduler import Scheduler
from metrale.engine.spec_cost_model import TABLE_FORMAT, CostTable, DraftLengthChooser, expected_tokens
from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import ModelRunnerOutput

IDENTITY = {"drafter": {"method": "ngram", "sha256": "ab" * 32},
            "target": {"architecture": "LlamaForCausalLM", "config_sha256": "cd" * 32, "dtype": "bfloat16"},
            "device": "NVIDIA H200"}


def table_json(batch_sizes=(1, 16, 256), ks=range(9), slope=None, draft=0.0):
    """plain(B) = 1 ms + 10 us per request; a verify step of k drafts costs plain * (1 + slope(B) * k):
    3% per draft at batch 1 (memory-bound: drafts ride along), 100% at batch 256 (compute-bound)."""
    slope = slope or {1: 0.03, 16: 0.2, 256: 1.0}
    plain = {b: 1e-3 + 1e-5 * b for b in batch_sizes}
    return {"format": TABLE_FORMAT, "identity": json.loads(json.dumps(IDENTITY)), "recorded": {"commit": "x"},
            "batch_sizes": list(batch_sizes), "num_drafts": list(ks),
            "verify_s": [[plain[b] * (1 + slope[b] * k) for k in ks] for b in batch_sizes],
            "draft_s": [[draft * k for k in ks] for b in batch_sizes]}


def chooser(max_drafts=8, **kw):
    return DraftLengthChooser(CostTable.from_json(table_json(**kw)), max_drafts)


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == 1.0 + 0.5 + 0.25
    assert expected_tokens([1.0] * 4, 4) == 5.0


def test_drafting_pays_at_batch_1_and_not_at_large_batch(caplog):
    c = chooser()
    assert c.acceptance() == [0.6] * 8  # the prior
    k1 = c.choose(1)
    assert 3 <= k1 <= 8
    assert c.choose(256) == 0  # each draft costs a whole plain step: E(k) / (1 + k) < 1
    assert 0 < c.choose(16) < k1  # in between, fewer drafts
    assert c.steps_per_k[0] == 1 and c.last_choice == c.choose(16)
    assert c.choose(1000) == 0  # clipped to the largest measured batch, and said once
    assert "batch 1000 is beyond the spec-cost table's largest measured batch 256" in caplog.text


def test_acceptance_moves_the_choice():
    c = chooser()
    prior_k = c.choose(1)
    for _ in range(300):
        c.observe(8, 8)  # every draft accepted
    assert c.acceptance()[0] > 0.95 and c.choose(1) == 8 > prior_k
    assert c.choose(16) > 0
    for _ in range(2000):
        c.observe(8, 0)  # the first draft always rejected
    assert c.acceptance()[0] < 0.03 and c.choose(1) == 0  # not even one draft pays 3%


def test_observe_counts_only_the_positions_a_draft_reached():
    c = DraftLengthChooser(CostTable.from_json(table_json()), 8, half_life=1e9)
    c.observe(3, 1)  # draft 0 accepted, draft 1 rejected, draft 2 never judged
    w, p = c.prior_weight, c.prior
    a = c.acceptance()
    assert a[0] == pytest.approx((1 + w * p) / (1 + w))
    assert a[1] == pytest.approx(w * p / (1 + w))
    assert a[2] == a[7] == pytest.approx(p)


def test_a_long_no_drafting_streak_probes_one_draft():
    c = DraftLengthChooser(CostTable.from_json(table_json()), 8, probe_every=4)
    for _ in range(2000):
        c.observe(8, 0)
    assert [c.choose(1) for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]
    # Where even the prior's acceptance would not draft, there is nothing to learn: no probe.
    assert all(c.choose(256) == 0 for _ in range(10))


def test_times_interpolate_between_batch_sizes_and_clip_outside():
    table = CostTable.from_json(table_json(batch_sizes=(1, 16, 256)))
    low, high = table.times(1, 4)[0], table.times(16, 4)[0]
    assert table.times(6, 4)[0] == pytest.approx(low + (high - low) * 5 / 15)
    assert table.times(1000, 4) == table.times(256, 4)
    assert table.times(0, 4) == table.times(1, 4)


def test_only_measured_k_up_to_num_speculative_tokens_are_candidates():
    c = DraftLengthChooser(CostTable.from_json(table_json(ks=(0, 2, 4, 8))), 5)
    assert c.candidates == [0, 2, 4]
    for _ in range(300):
        c.observe(4, 4)
    assert c.choose(1) == 4
    with pytest.raises(OptionError, match=r"draft counts \[0, 4, 8\], none of them between 1 and "
                                          "num_speculative_tokens 3"):
        DraftLengthChooser(CostTable.from_json(table_json(ks=(0, 4, 8))), 3)


def test_draft_time_counts_against_drafting():
    assert chooser().choose(1) > 0
    assert chooser(draft=1e-3).choose(1) == 0  # a drafter as slow as a plain step per draft never pays


def test_table_round_trips():
    table = CostTable.from_json(table_json())
    data = json.loads(json.dumps(table.to_json()))
    assert CostTable.from_json(data) == table
    assert data["verify_over_plain"]["1"][4] == pytest.approx(1.12)


def _broken(change):
    data = table_json(batch_sizes=(1, 2), ks=(0, 1, 2), slope={1: 0.03, 2: 0.1})
    change(data)
    return data


@pytest.mark.parametrize("data, message", [
    ([1, 2], "not a JSON object"),
    (_broken(lambda d: d.update(format="other/9")), "format is 'other/9'"),
    (_broken(lambda d: d.pop("verify_s")), "no 'verify_s'"),
    (_broken(lambda d: d["identity"].pop("drafter")), "'identity' must hold drafter, target, device"),
    (_broken(lambda d: d.update(batch_sizes=[2, 1])), "'batch_sizes' must be a non-empty ascending list"),
    (_broken(lambda d: d.update(num_drafts=[1, 2, 3])), "'num_drafts' must start at 0"),
    (_broken(lambda d: d.update(num_drafts=[0], verify_s=[[1.0], [1.0]], draft_s=[[0.0], [0.0]])),
     "holds no draft count above 0"),
    (_broken(lambda d: d["draft_s"].pop()), "'draft_s' must be 2 rows"),
    (_broken(lambda d: d["verify_s"][1].__setitem__(2, -1.0)), "'verify_s' holds a time that is not a number"),
    (_broken(lambda d: d["verify_s"][0].__setitem__(0, 0.0)), "a plain step"),
])
def test_a_malformed_table_is_refused_by_name(data, message):
    pattern = "spec-cost calibration t.json is malformed: .*" + message.replace("[", r"\[")
    with pytest.raises(OptionError, match=pattern):
        CostTable.from_json(data, "t.json")


def test_a_table_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(OptionError, match="is malformed: not JSON"):
        CostTable.load(str(path))
    with pytest.raises(OptionError, match="cannot read it"):
        CostTable.load(str(tmp_path / "missing.json"))


def test_a_table_for_another_setup_is_refused_naming_what_differs():
    table = CostTable.from_json(table_json())
    table.check_identity(json.loads(json.dumps(IDENTITY)))  # the same setup: accepted
    other = json.loads(json.dumps(IDENTITY))
    other["drafter"]["sha256"] = "ef" * 32
    other["device"] = "NVIDIA A100"
    with pytest.raises(OptionError, match=r"differs in device: table 'NVIDIA H200', this engine 'NVIDIA A100'; "
                                          r"drafter.sha256: table 'abab.*', this engine 'efef"):
        table.check_identity(other, "t.json")


# -- the scheduler drafts the chosen k --------------------------------------------------------

REPEAT = [5, 6, 7, 8] * 4


def make_request(rid, prompt):
    return Request(rid, list(prompt), SamplingParams(max_tokens=32, ignore_eos=True), seed=0)


def run_step(s: Scheduler, num_accepted=0, token=8):
    plan, _ = s.schedule()
    result = ModelRunnerOutput()
    for rid in plan.num_scheduled_tokens:
        if s.requests[rid].num_pending:
            result.sampled_token_ids[rid] = token
            if rid in plan.draft_token_ids:
                result.num_accepted_drafts[rid] = min(num_accepted, len(plan.draft_token_ids[rid]))
    s.update(plan, result)
    return plan


def test_the_scheduler_drafts_the_chosen_k_per_step():
    # k = 2 at most in the table; drafting pays at batch 1 only (the second request makes it 2).
    table = CostTable.from_json(table_json(batch_sizes=(1, 2), ks=(0, 1, 2), slope={1: 0.03, 2: 2.0}))
    c = DraftLengthChooser(table, 3)
    s = Scheduler(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                  drafter=NgramDrafter(3, 1, 3), draft_length=c)
    s.add_request(make_request("a", REPEAT[:-1]))
    run_step(s)  # the prefill samples 8
    plan = run_step(s, num_accepted=1, token=99)
    assert plan.draft_token_ids == {"a": [5, 6]}  # 2 drafts, not the drafter's 3
    assert plan.num_scheduled_tokens == {"a": 3}
    assert c.acceptance()[0] > c.prior > c.acceptance()[1]  # the result taught the chooser
    s.add_request(make_request("b", REPEAT[:-1]))
    plan = run_step(s)  # the batch is 2 with b admitted: "a" decodes plainly beside b's prefill
    assert plan.draft_token_ids == {} and plan.num_scheduled_tokens == {"a": 1, "b": 15}
    plan = run_step(s)
    assert plan.draft_token_ids == {} and plan.num_scheduled_tokens == {"a": 1, "b": 1}
    assert c.steps_per_k == {2: 2, 0: 2}  # the prefill step alone chose too
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    run_step(s)
    assert c.last_choice == 2  # alone again: drafting pays


# -- configuration ----------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def test_configuration():
    spec = EngineArgs(speculative_config=NGRAM).speculative_decoding
    assert (spec.cost_model, spec.cost_calibration) == ("static", None)
    spec = EngineArgs(speculative_config=NGRAM, spec_cost_model="measured", spec_cost_calibration="t.json"
                      ).speculative_decoding
    assert (spec.cost_model, spec.cost_calibration) == ("measured", "t.json")
    spec = EngineArgs(speculative_config=dict(NGRAM, cost_model="measured", cost_calibration="t.json")
                      ).speculative_decoding
    assert (spec.cost_model, spec.cost_calibration) == ("measured", "t.json")


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_config=dict(NGRAM, cost_model="measured")), "cost_model 'measured' needs a calibration table"),
    (dict(speculative_config=NGRAM, spec_cost_model="measured"), "cost_model 'measured' needs a calibration table"),
    (dict(speculative_config=dict(NGRAM, cost_model="fast")), "cost_model must be one of static, measured"),
    (dict(speculative_config=NGRAM, spec_cost_calibration="t.json"), "read only with cost_model 'measured'"),
    (dict(speculative_config=dict(NGRAM, cost_model="static"), spec_cost_model="measured",
          spec_cost_calibration="t.json"), "spec_cost_model 'measured' and speculative_config's cost_model 'static'"),
    (dict(spec_cost_model="measured"), "spec_cost_model configures a drafter"),
])
def test_configuration_refusals(kwargs, message):
    with pytest.raises(OptionError, match=message):
        EngineArgs.from_kwargs(**kwargs)
