"""MTP drafting on the hybrid Qwen families (models/qwen_mtp.py): Qwen3-Next, Qwen3.5 dense and
Qwen3.5 MoE, with an `mtp.*` layer the test writes in the published layout (mtp.fc,
mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.* = a full-attention decoder layer
with layer 0's MLP, mtp.norm) into transformers' own tiny checkpoint. transformers ignores `mtp.*`.

- Lossless greedy: tokens with MTP drafting == transformers' == the engine's without speculation,
  batched prompts of mixed lengths, k = 1 and chained k = 2; the target's Gated DeltaNet state is
  rolled back per draft (BatchLayout.drafts) where drafts are rejected. Also chunked prefill with
  forced preemption, prefix hits, tp=2.
- The drafter: every draft == a plain-torch reference (transformers' Qwen3-Next / Qwen3.5 decoder
  layer holding the MTP layer's tensors, and fc / the norms in plain torch over transformers' trunk).
- Acceptance: an MTP layer built to pass the trunk's hidden state through (so it drafts the
  target's last token again) is accepted where the target repeats itself, and rejected elsewhere.
- The sha256 (recomputed here) and its startup log line; the plan counts the MTP layer's KV; the
  layouts met does not load are refused by name, GLM-5.3's too; per-family default k.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from hybrid_checkpoints import SPEC_INITIALIZER_RANGE, make_hybrid_checkpoint
from hybrid_checkpoints import spec_prompts as make_prompts
from metrale import LLM, SamplingParams
from metrale.config.engine_args import EngineArgs
from qwen_mtp_checkpoints import MTP_GREEDY as GREEDY, MTP_NEW_TOKENS as NEW_TOKENS
from qwen_mtp_checkpoints import (LAYERS, ReferenceMTP, assert_drafted_and_idle, assert_drafts_equal_reference, greedy,
                                  mtp_checkpoint_cache, mtp_engine, write_mtp_layer)



@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return mtp_checkpoint_cache(tmp_path_factory, "qwen_mtp", lambda path, family: make_hybrid_checkpoint(
        path, family, num_hidden_layers=LAYERS, initializer_range=SPEC_INITIALIZER_RANGE))


@pytest.mark.parametrize("family, k", [("qwen3_next", 2), ("qwen3_5", 1), ("qwen3_5_moe", 2)])
def test_greedy_tokens_equal_transformers_and_plain_decoding(checkpoints, family, k):
    _, path, _, expected = checkpoints(family)
    llm = mtp_engine(path, k)
    assert greedy(llm) == expected
    assert_drafted_and_idle(llm)
    runner = llm.llm_engine.runner
    assert runner.drafter.sha256 == runner.model.mtp_sha256 is not None
    if family == "qwen3_next":
        assert greedy(LLM(path, dtype="float32", device="cpu")) == expected  # no speculation


def test_chunked_prefill_and_preemption(checkpoints):
    _, path, _, expected = checkpoints("qwen3_next")
    llm = mtp_engine(path, 2, max_num_batched_tokens=12, num_kv_blocks=24, block_size=4)
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_drafted_and_idle(llm)


def test_prefix_hits(checkpoints):
    _, path, _, expected = checkpoints("qwen3_5")
    llm = mtp_engine(path, 2, block_size=8, enable_prefix_caching=True)
    assert greedy(llm) == expected
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits


def test_tensor_parallel_two_ranks(checkpoints):
    _, path, _, expected = checkpoints("qwen3_next")
    llm = mtp_engine(path, 2, tp_size=2, max_num_batched_tokens=16)
    assert greedy(llm) == expected
    assert_drafted_and_idle(llm)


# -- the drafter against a plain-torch reference --------------------------------------------------


@pytest.mark.parametrize("family, k", [("qwen3_next", 2), ("qwen3_5", 1), ("qwen3_5_moe", 2)])
def test_drafts_equal_the_reference_mtp_forward(checkpoints, family, k, monkeypatch, tmp_path):
    base, path, mtp, _ = checkpoints(family)
    reference = ReferenceMTP(base, mtp, str(tmp_path / "holder"))
    checked = assert_drafts_equal_reference(lambda: mtp_engine(path, k), reference, make_prompts()[1:3], GREEDY, k,
                                            monkeypatch)
    assert checked >= 2 * (NEW_TOKENS // (k + 1))


# -- acceptance --------------------------------------------------------------------------------------


def test_a_passthrough_mtp_layer_is_accepted_where_the_target_repeats(checkpoints, tmp_path):
    base, _, _, expected = checkpoints("qwen3_next")
    path = str(tmp_path / "passthrough")
    write_mtp_layer(base, path, passthrough=True)
    repetitive = [5] * 8  # this tiny model answers it with one token nine times over
    expected = expected + [reference_greedy(load_reference(base), repetitive, NEW_TOKENS)]
    llm = mtp_engine(path, 2)
    assert greedy(llm, make_prompts() + [repetitive]) == expected
    repeats = sum(a == b for tokens in expected for a, b in zip(tokens, tokens[1:]))
    assert repeats >= 4  # where the target repeats itself the draft is right
    stats = llm.llm_engine.scheduler.spec_stats
    # Accepted where it repeats, rejected elsewhere: the kept Gated DeltaNet state is the one of
    # the last accepted position both ways, or the tokens above would differ.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    # Sampled, seeded: each request's tokens are the same alone and batched (its own streams),
    # with drafts accepted under sampling too (the tiny model's logits are flat: a low temperature
    # keeps its repeats likely enough to accept).
    accepted = stats.num_accepted_tokens
    prompts = [{"prompt_token_ids": p} for p in make_prompts()[:3] + [repetitive]]
    params = [SamplingParams(temperature=0.05, top_k=20, seed=10 + i, max_tokens=NEW_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], [q], use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert batched == alone
    assert stats.num_accepted_tokens > accepted


# -- hash, plan, defaults, refusals --------------------------------------------------------------------


def test_the_hash_is_over_the_stored_mtp_tensors_and_logged(checkpoints, caplog):
    from safetensors import safe_open

    _, path, mtp, _ = checkpoints("qwen3_5")
    digest = hashlib.sha256()
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for name in sorted(mtp):
            digest.update(name.encode())
            digest.update(f.get_tensor(name).contiguous().numpy().tobytes())
    with caplog.at_level(logging.INFO, logger="metrale.executor.model_loader"):
        llm = LLM(path, dtype="float32", device="cpu")
    model = llm.llm_engine.runner.model
    assert model.mtp_sha256 == digest.hexdigest() and model.mtp_tensor_count == len(mtp) == 15
    assert f"MTP: 1 layer(s), {len(mtp)} tensors" in caplog.text and digest.hexdigest() in caplog.text
    # Without drafting the MTP layer has no cache: the layout is the trunk's.
    assert [entry.layer_index for entry in llm.llm_engine.runner.layout.layers] == list(range(LAYERS))


def test_the_mtp_kv_cache_is_counted_in_the_plan_and_k_defaults_per_family(checkpoints):
    from metrale.config.model_config import load_model_config
    from metrale.models.registry import supported_architectures
    from metrale.startup.memory import plan_memory

    _, path, _, _ = checkpoints("qwen3_next")
    config = load_model_config(path, "float32", torch.device("cpu"), None, supported_architectures())

    def plan(**kwargs):
        return plan_memory(EngineArgs(model=path, dtype="float32", **kwargs), config, torch.device("cpu"))

    plain, drafting = plan(), plan(speculative_config={"method": "mtp"})
    hf = config.hf_config  # one more full-attention layer's K and V per token, float32
    assert drafting.kv_bytes_per_token - plain.kv_bytes_per_token == 2 * hf.num_key_value_heads * hf.head_dim * 4
    assert EngineArgs(model=path, speculative=True).speculative_decoding.num_speculative_tokens == 2  # Qwen
    assert EngineArgs(model=path, speculative=True, num_drafts=3).speculative_decoding.num_speculative_tokens == 3
    assert drafting.num_draft_state_slots == drafting.max_num_seqs * 2  # the default k's scratch slots


def test_k_defaults_to_the_next_n_layer_count_for_deepseek(tmp_path):
    config = {"architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert EngineArgs(model=str(tmp_path), speculative=True).speculative_decoding.num_speculative_tokens == 1
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=3)))
    assert EngineArgs(model=str(tmp_path), speculative=True).speculative_decoding.num_speculative_tokens == 3


@pytest.mark.parametrize("edits, reason", [({"mtp_num_hidden_layers": 2}, "declares 2 MTP layers"),
                                           ({"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings")])
def test_layouts_met_does_not_load_are_refused_by_name(checkpoints, tmp_path, edits, reason):
    base, _, _, expected = checkpoints("qwen3_5")
    path = str(tmp_path / "other_layout")
    write_mtp_layer(base, path, **edits)
    with pytest.raises(ValueError, match=reason):
        mtp_engine(path, 1)
    llm = LLM(path, dtype="float32", device="cpu")  # without drafting: loads, the mtp.* tensors ignored
    assert not hasattr(llm.llm_engine.runner.model, "mtp")
    assert greedy(llm) == expected


def test_a_checkpoint_without_mtp_tensors_is_refused(checkpoints):
    base, _, _, _ = checkpoints("qwen3_5")
    with pytest.raises(ValueError, match="holds none"):
        LLM(base, dtype="float32", device="cpu", speculative=True)


def test_glm_5_3_mtp_is_refused_by_name(tmp_path):
    from glm5_next_checkpoints import make_glm5_next_checkpoint

    path = make_glm5_next_checkpoint(str(tmp_path / "glm53"))
    with pytest.raises(ValueError, match="GLM-5.3's next-n layer layout"):
        LLM(path, dtype="float32", device="cpu", speculative=True)
