"""`met benchmark spec-cost-table` on the CPU: a tiny checkpoint, a tiny grid, a table the engine
then loads with --spec-cost-model measured (greedy tokens equal to plain decoding's, drafting at
batch 1 and not in a batch where the table says it does not pay), and the tables it refuses: one
for another drafter or target, a malformed one."""

from __future__ import annotations

import json

import pytest

from metrale import LLM, SamplingParams
from metrale.config.errors import OptionError
from metrale.engine.spec_cost_identity import ngram_sha256
from metrale.engine.spec_cost_model import CostTable
from metrale.entrypoints.cli import build_parser, main

SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 6, [20, 21, 22] * 10 + [23], [40, 41, 42, 43] * 5, [7, 3, 9, 11, 13, 2, 200]]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """(checkpoint, table path): the benchmark's run, batch sizes 1 and 2, k 0..2."""
    from checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("spec_cost")
    path = make_checkpoint(str(root / "llama"), "llama")
    out = str(root / "table.json")
    status = main(["benchmark", "spec-cost-table", "--model", path, "--device", "cpu", "--dtype", "float32",
                   "--speculative-config", json.dumps(SPEC), "--batch-sizes", "1,2", "--draft-counts", "1,2",
                   "--context-len", "8", "--warmup", "1", "--repetitions", "2", "-o", out])
    assert status == 0
    return path, out


def engine(path, table_path, **kwargs):
    return LLM(path, dtype="float32", device="cpu", speculative_config=SPEC, spec_cost_model="measured",
               spec_cost_calibration=table_path, **kwargs)


def rewrite(table_path, tmp_path, change) -> str:
    with open(table_path) as f:
        data = json.load(f)
    change(data)
    out = tmp_path / "changed.json"
    out.write_text(json.dumps(data))
    return str(out)


def test_the_benchmark_writes_a_table_of_real_steps(measured):
    _, table_path = measured
    table = CostTable.load(table_path)
    assert table.batch_sizes == (1, 2) and table.num_drafts == (0, 1, 2)
    assert all(t > 0 for row in table.verify_s for t in row)
    assert all(row[0] == 0 and row[1] > 0 for row in table.draft_s)  # the n-gram lookups, timed
    assert table.identity["drafter"] == {"method": "ngram", "sha256": ngram_sha256(1, 3)}
    assert table.identity["target"]["architecture"] == "LlamaForCausalLM"
    assert table.identity["target"]["dtype"] == "float32" and table.identity["device"] == "cpu"
    assert {"torch", "triton", "commit", "repetitions", "context_len"} <= set(table.recorded)
    assert table.recorded["num_speculative_tokens"] == 2 and table.recorded["verify_graphs"] is False  # CPU


def test_measured_greedy_equals_plain_and_drafts_where_it_pays(measured, tmp_path):
    path, table_path = measured
    plain = LLM(path, dtype="float32", device="cpu")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]

    def batch1_only(data):  # the measured times, then: drafts ride free at batch 1, cost a step each at 2
        data["verify_s"][0] = [data["verify_s"][0][0]] * 3
        data["verify_s"][1] = [data["verify_s"][1][0] * (1 + 2 * k) for k in range(3)]

    llm = engine(path, rewrite(table_path, tmp_path, batch1_only))
    chooser = llm.llm_engine.scheduler.draft_length
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert batched == expected
    assert chooser.steps_per_k.get(2, 0) == 0 and llm.llm_engine.scheduler.spec_stats.num_drafts == 0
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == expected
    assert chooser.steps_per_k[2] > 0
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and max(stats.accepted_per_position[:2]) > 0
    assert chooser.acceptance() != [chooser.prior] * 2  # the verify results moved the estimate


def test_a_table_for_another_drafter_or_target_is_refused(measured, tmp_path):
    path, table_path = measured
    other_drafter = rewrite(table_path, tmp_path, lambda d: d["identity"]["drafter"].update(sha256="0" * 64))
    with pytest.raises(OptionError, match=r"measured for another setup; it differs in drafter.sha256: table '0000"):
        engine(path, other_drafter)
    # The same table, another drafter configuration: prompt lookup over other n-gram sizes.
    with pytest.raises(OptionError, match="differs in drafter.sha256"):
        LLM(path, dtype="float32", device="cpu", speculative_config=dict(SPEC, prompt_lookup_min=2),
            spec_cost_model="measured", spec_cost_calibration=table_path)
    other_target = rewrite(table_path, tmp_path, lambda d: d["identity"]["target"].update(config_sha256="1" * 64))
    with pytest.raises(OptionError, match="differs in target.config_sha256"):
        engine(path, other_target)
    with pytest.raises(OptionError, match="differs in target.config_sha256"):
        engine(path, table_path, load_format="dummy", hf_overrides={"num_hidden_layers": 1})  # a cut model


def test_a_malformed_table_is_refused_by_name(measured, tmp_path):
    path, table_path = measured
    broken = rewrite(table_path, tmp_path, lambda d: d.pop("verify_s"))
    with pytest.raises(OptionError, match=r"spec-cost calibration .*changed.json is malformed: no 'verify_s'"):
        engine(path, broken)


def test_a_runner_side_drafter_is_timed_inside_its_steps(tmp_path):
    """DFlash drafts in the runner after every step: its table is keyed by the drafter checkpoint's
    sha256, its draft time is part of each step's, and the engine that reads it decodes losslessly."""
    from dflash_checkpoints import make_dflash_drafter, make_dflash_target

    target = make_dflash_target(str(tmp_path / "target"))
    drafter_dir = make_dflash_drafter(str(tmp_path / "drafter"), target)
    spec = {"method": "dflash", "model": drafter_dir, "num_speculative_tokens": 2}
    out = str(tmp_path / "table.json")
    assert main(["benchmark", "spec-cost-table", "--model", target, "--device", "cpu", "--dtype", "float32",
                 "--speculative-config", json.dumps(spec), "--batch-sizes", "1", "--draft-counts", "1,2",
                 "--context-len", "8", "--warmup", "0", "--repetitions", "1", "-o", out]) == 0
    table = CostTable.load(out)
    assert table.recorded["drafter_in_runner"] and all(t == 0 for t in table.draft_s[0])
    llm = LLM(target, dtype="float32", device="cpu", speculative_config=spec, spec_cost_model="measured",
              spec_cost_calibration=out)
    assert table.identity["drafter"] == {"method": "dflash", "sha256": llm.llm_engine.runner.drafter.sha256}
    plain = LLM(target, dtype="float32", device="cpu")
    prompts, params = [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert sum(llm.llm_engine.scheduler.draft_length.steps_per_k.values()) > 0


def test_bench_and_benchmark_name_one_command():
    parser = build_parser()
    a = parser.parse_args(["benchmark", "spec-cost-table", "-o", "t.json", "--batch-sizes", "4,1,2"])
    b = parser.parse_args(["bench", "spec-cost-table", "-o", "t.json"])
    assert a.handler is b.handler and a.batch_sizes == [1, 2, 4] and b.draft_counts == list(range(9))


def test_under_asynchronous_scheduling_steps_are_timed_in_runs(tmp_path):
    """With asynchronous scheduling the n-gram drafter runs in the runner and a step overlaps the
    next one's planning: the benchmark times runs of steps, checks each run verified its drafts,
    and records the scheduling with the table (its drafting inside the steps: draft_s 0)."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(str(tmp_path / "llama"), "llama")
    out = str(tmp_path / "table.json")
    status = main(["benchmark", "spec-cost-table", "--model", path, "--device", "cpu", "--dtype", "float32",
                   "--async-scheduling", "--speculative-config", json.dumps(SPEC), "--batch-sizes", "1,2",
                   "--draft-counts", "1,2", "--context-len", "8", "--warmup", "2", "--repetitions", "3", "-o", out])
    assert status == 0
    table = CostTable.load(out)
    assert all(t > 0 for row in table.verify_s for t in row)
    assert all(t == 0 for row in table.draft_s for t in row)
    assert table.recorded["async_scheduling"] is True and table.recorded["drafter_in_runner"] is True
