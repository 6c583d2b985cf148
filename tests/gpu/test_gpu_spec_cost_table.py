"""On the GPU: `met benchmark spec-cost-table` times the engine's own steps (CUDA graphs, CUDA
events) on a tiny Llama, keys the table by this GPU's name, and an engine with
--spec-cost-model measured and that table gives plain decoding's greedy tokens."""

import json

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine.spec_cost_model import CostTable
from metrale.entrypoints.cli import main

pytestmark = pytest.mark.gpu

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 9] * 6, [20, 21, 22] * 10 + [23], [40, 41, 42, 43] * 5, [7, 3, 9, 11, 13, 2, 200]]


def test_the_table_of_a_gpu_and_the_engine_that_reads_it(checkpoint_factory, tmp_path):
    path = checkpoint_factory("llama")
    out = str(tmp_path / "table.json")
    assert main(["benchmark", "spec-cost-table", "--model", path, "--device", "cuda", "--dtype", "float32",
                 "--speculative-config", json.dumps(SPEC), "--batch-sizes", "1,2,4", "--draft-counts", "0,1,2,3",
                 "--context-len", "32", "--max-num-seqs", "16", "-o", out]) == 0
    table = CostTable.load(out)
    assert table.identity["device"] == torch.cuda.get_device_name()
    assert table.recorded["decode_graphs"] and table.recorded["num_speculative_tokens"] == 3
    assert all(t > 0 for row in table.verify_s for t in row)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(path, dtype="float32", device="cuda", max_num_seqs=16)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=16, speculative_config=SPEC,
              spec_cost_model="measured", spec_cost_calibration=out)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts] == expected
    assert sum(llm.llm_engine.scheduler.draft_length.steps_per_k.values()) > 0
