"""DeepSeek-V3.2 in block FP8, as DeepSeek publishes it, end to end on the CPU against
transformers on the dequantized float32 weights (W8A16: `activation_quantization="none"`).

The tiny checkpoint is tests/dsa_checkpoints.py's, quantized by tests/fp8_checkpoints.py in
[32, 32] blocks: every projection FP8 with its weight_scale_inv, the indexer's wq_b ([512, 48]:
a partial column block) and wk included; the indexer's weights_proj stays unquantized, as in
DeepSeek's checkpoint (its reference keeps it in the model dtype, and met in float32), with no
modules_to_not_convert in the config to say so. Greedy ids equal transformers' for prompts of
1..250 tokens batched, the selections sparse (index_topk 24).
"""

from __future__ import annotations

import json
import os

import pytest

from checkpoints import load_reference, reference_greedy
from dsa_checkpoints import make_dsa_checkpoint
from fp8_checkpoints import quantize_checkpoint
from metrale import LLM
from test_fp8_models import NEW_TOKENS, _greedy, make_prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    source = make_dsa_checkpoint(str(tmp_path_factory.mktemp("dsa_source")), "deepseek_v32")
    root = tmp_path_factory.mktemp("fp8_dsa")
    fp8, dequantized = quantize_checkpoint(source, str(root / "fp8"), str(root / "dequantized"), (32, 32),
                                           not_converted=("weights_proj",))
    config_path = os.path.join(fp8, "config.json")
    config = json.load(open(config_path))
    del config["quantization_config"]["modules_to_not_convert"]  # the published config names none
    json.dump(config, open(config_path, "w"))
    return fp8, dequantized


def test_weight_only_fp8_matches_transformers(checkpoints):
    fp8, dequantized = checkpoints
    prompts = make_prompts()
    reference = load_reference(dequantized)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    llm = LLM(fp8, dtype="float32", device="cpu", activation_quantization="none")
    indexer = llm.llm_engine.runner.model.model.layers[0].self_attn.indexer
    assert indexer.wq_b.fp8 is not None and indexer.wk.fp8 is not None  # the indexer's projections run in FP8
    assert _greedy(llm, prompts) == expected
    llm.close()
