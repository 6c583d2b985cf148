"""`--load-format dummy` builds the MTP layers a config declares, with random weights drawn under
the checkpoint's names (loader/weights.py's dummy_checkpoint, each layer's
`dummy_checkpoint_shapes`), so MTP drafting runs on the shipped configs without weights:

- `met bench latency --speculative-config '{"method": "mtp"}'` on Qwen3-Next-80B's config (which
  names no MTP count: one layer, as its checkpoint holds) and on Qwen3-8B's with
  `num_nextn_predict_layers: 1` in --hf-overrides (met's dense layout), both cut to tiny sizes;
- greedy tokens with dummy MTP drafts == plain greedy on the same dummy weights;
- the dummy MTP sha256 (of the seed and the tensors' names and shapes) is logged and keys the run;
- Qwen3-8B without a declared count builds no MTP layer, nor Qwen3-Next cut below its first
  full-attention layer, and `method: "mtp"` is refused by name.
"""

from __future__ import annotations

import json
import logging

import pytest

from metrale import LLM, SamplingParams
from metrale.entrypoints.cli import main

NEXT = "metrale/model_configs/Qwen3-Next-80B-A3B-Instruct"
Q8 = "metrale/model_configs/Qwen3-8B"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 512}
TINY_NEXT = dict(TINY, num_hidden_layers=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                 num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16)
TINY_Q8 = dict(TINY, num_hidden_layers=2)
MTP = {"method": "mtp"}


def bench_latency(model: str, overrides: dict) -> list[str]:
    return ["bench", "latency", "--model", model, "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
            "--hf-overrides", json.dumps(overrides), "--speculative-config", json.dumps(MTP), "--batch-size", "1",
            "--input-len", "16", "--output-len", "8", "--max-model-len", "64", "--num-iters", "1",
            "--num-iters-warmup", "0"]


@pytest.mark.parametrize("model, overrides, k", [(NEXT, TINY_NEXT, 2), (Q8, dict(TINY_Q8, num_nextn_predict_layers=1), 1)])
def test_bench_latency_drafts_with_dummy_mtp_layers(model, overrides, k, capsys, caplog):
    with caplog.at_level(logging.INFO):
        assert main(bench_latency(model, overrides)) == 0
    assert "speculative decoding  acceptance" in capsys.readouterr().out
    assert "MTP: 1 dummy layer(s)" in caplog.text
    assert f"(mtp, k = {k}, sha256 " in caplog.text  # the family's default k, keyed by the dummy hash


@pytest.mark.parametrize("model, overrides", [(NEXT, TINY_NEXT), (Q8, dict(TINY_Q8, num_nextn_predict_layers=1))])
def test_dummy_mtp_drafts_are_lossless(model, overrides):
    prompts = [{"prompt_token_ids": [5 + i, 7, 9] * (i + 1)} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def tokens(**kwargs):
        llm = LLM(model, load_format="dummy", device="cpu", dtype="float32", hf_overrides=overrides,
                  skip_tokenizer_init=True, max_model_len=64, **kwargs)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    drafting, drafted = tokens(speculative_config=dict(MTP, num_speculative_tokens=2))
    plain, expected = tokens()
    assert drafted == expected
    assert drafting.llm_engine.scheduler.spec_stats.num_drafts > 0
    model_ = drafting.llm_engine.runner.model
    assert len(model_.mtp) == 1 and model_.mtp_sha256 == plain.llm_engine.runner.model.mtp_sha256 is not None


def assert_no_dummy_mtp_layer(config_dir: str, overrides: dict, refusal: str) -> None:
    """Dummy weights of the config: no MTP layer (a plain run starts), and `method: "mtp"` refused."""
    def dummy(**kwargs):
        return LLM(config_dir, load_format="dummy", device="cpu", dtype="float32", hf_overrides=overrides,
                   skip_tokenizer_init=True, max_model_len=64, **kwargs)

    assert not hasattr(dummy().llm_engine.runner.model, "mtp")
    with pytest.raises(ValueError, match=refusal):
        dummy(speculative_config=MTP)


def test_a_dense_config_without_a_declared_count_builds_no_mtp_layer():
    assert_no_dummy_mtp_layer(Q8, TINY_Q8, "declares no MTP layers")


def test_a_hybrid_trunk_cut_below_its_first_full_attention_layer_drafts_no_dummy_mtp():
    """Qwen3-Next cut to 2 layers (both Gated DeltaNet): no layer to shape the MTP attention on,
    so the dummy model has none (a plain run works) and `method: "mtp"` is refused naming why."""
    assert_no_dummy_mtp_layer(NEXT, dict(TINY_NEXT, num_hidden_layers=2),
                              "no full-attention layer to shape the dummy MTP layer")
