"""MTP drafting on the dense families (Llama, Qwen3) with met's own `mtp.*` layout
(models/qwen_mtp.py's DENSE_LAYOUT: Qwen3-Next's shape with the family's standard RMSNorm and its
own decoder layer), declared by `num_nextn_predict_layers: 1`, which transformers ignores. The
test writes random `mtp.*` tensors into transformers' own tiny checkpoint
(tests/qwen_mtp_checkpoints.py's write_mtp_layer).

- Lossless greedy: tokens with MTP drafting == transformers' == the engine's without speculation,
  batched prompts of mixed lengths, k = 1 and chained k = 2; chunked prefill with forced
  preemption; prefix hits.
- The drafter: every draft == a plain-torch reference (transformers' own decoder layer holding the
  MTP layer's tensors, fc and the standard norms over transformers' trunk).
- Acceptance: a passthrough MTP layer (it drafts the target's last token again) is accepted where
  the target repeats itself and rejected elsewhere.
- The sha256 (recomputed here) and its startup line; k defaults to 1; a config declaring two
  layers, or none over `mtp.*` tensors, loads without MTP and `method: "mtp"` is refused by name.
"""

from __future__ import annotations

import hashlib
import logging
import os

import pytest

from checkpoints import load_reference, make_checkpoint, reference_greedy
from hybrid_checkpoints import SPEC_INITIALIZER_RANGE
from hybrid_checkpoints import spec_prompts as make_prompts
from metrale import LLM
from metrale.config.engine_args import EngineArgs
from qwen_mtp_checkpoints import MTP_GREEDY as GREEDY, MTP_NEW_TOKENS as NEW_TOKENS
from qwen_mtp_checkpoints import (DENSE, ReferenceMTP, assert_drafted_and_idle, assert_drafts_equal_reference, greedy,
                                  mtp_checkpoint_cache, mtp_engine, write_mtp_layer)

LAYERS = 2  # checkpoints.py's tiny models; the MTP layer is the last one's tensors times 1.5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return mtp_checkpoint_cache(tmp_path_factory, "dense_mtp", lambda path, family: make_checkpoint(
        path, family, num_hidden_layers=LAYERS, initializer_range=SPEC_INITIALIZER_RANGE), **DENSE)


@pytest.mark.parametrize("family, k", [("llama", 2), ("qwen3", 1)])
def test_greedy_tokens_equal_transformers_and_plain_decoding(checkpoints, family, k):
    _, path, _, expected = checkpoints(family)
    llm = mtp_engine(path, k)
    assert greedy(llm) == expected
    assert_drafted_and_idle(llm)
    runner = llm.llm_engine.runner
    assert runner.drafter.sha256 == runner.model.mtp_sha256 is not None
    assert greedy(LLM(path, dtype="float32", device="cpu")) == expected  # no speculation


def test_chunked_prefill_and_preemption(checkpoints):
    _, path, _, expected = checkpoints("qwen3")
    llm = mtp_engine(path, 2, max_num_batched_tokens=12, num_kv_blocks=16, block_size=4)
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_drafted_and_idle(llm)


def test_prefix_hits(checkpoints):
    _, path, _, expected = checkpoints("llama")
    llm = mtp_engine(path, 1, block_size=8, enable_prefix_caching=True)
    assert greedy(llm) == expected
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits


@pytest.mark.parametrize("family, k", [("llama", 2), ("qwen3", 1)])
def test_drafts_equal_the_reference_mtp_forward(checkpoints, family, k, monkeypatch, tmp_path):
    base, path, mtp, _ = checkpoints(family)
    reference = ReferenceMTP(base, mtp, str(tmp_path / "holder"))
    checked = assert_drafts_equal_reference(lambda: mtp_engine(path, k), reference, make_prompts()[1:3], GREEDY, k,
                                            monkeypatch)
    assert checked >= 2 * (NEW_TOKENS // (k + 1))


def test_a_passthrough_mtp_layer_is_accepted_where_the_target_repeats(checkpoints, tmp_path):
    base, _, _, expected = checkpoints("llama")
    path = str(tmp_path / "passthrough")
    write_mtp_layer(base, path, passthrough=True, **DENSE)
    repetitive = [5] * 8
    expected = expected + [reference_greedy(load_reference(base), repetitive, NEW_TOKENS)]
    llm = mtp_engine(path, 2)
    assert greedy(llm, make_prompts() + [repetitive]) == expected
    repeats = sum(a == b for tokens in expected for a, b in zip(tokens, tokens[1:]))
    assert repeats >= 4  # where the target repeats itself the draft is right
    stats = llm.llm_engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_the_hash_is_over_the_stored_mtp_tensors_and_logged(checkpoints, caplog):
    from safetensors import safe_open

    _, path, mtp, _ = checkpoints("qwen3")
    digest = hashlib.sha256()
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for name in sorted(mtp):
            digest.update(name.encode())
            digest.update(f.get_tensor(name).contiguous().numpy().tobytes())
    with caplog.at_level(logging.INFO, logger="metrale.executor.model_loader"):
        llm = LLM(path, dtype="float32", device="cpu")
    model = llm.llm_engine.runner.model
    # 4 projections + q/k norms + 3 MLP projections + 2 layer norms, fc, 3 norms
    assert model.mtp_sha256 == digest.hexdigest() and model.mtp_tensor_count == len(mtp) == 15
    assert f"MTP: 1 layer(s), {len(mtp)} tensors" in caplog.text and digest.hexdigest() in caplog.text
    assert [entry.layer_index for entry in llm.llm_engine.runner.layout.layers] == list(range(LAYERS))
    assert EngineArgs(model=path, speculative=True).speculative_decoding.num_speculative_tokens == 1


@pytest.mark.parametrize("edits, reason", [({"num_nextn_predict_layers": 2}, "declares 2 MTP layers"),
                                           ({"num_nextn_predict_layers": 0}, "declares no MTP layers")])
def test_undeclared_and_two_layer_configs_are_refused_by_name(checkpoints, tmp_path, edits, reason):
    base, _, _, expected = checkpoints("llama")
    path = str(tmp_path / "other_layout")
    write_mtp_layer(base, path, **DENSE, **edits)
    with pytest.raises(ValueError, match=reason):
        mtp_engine(path, 1)
    llm = LLM(path, dtype="float32", device="cpu")  # without drafting: loads, the mtp.* tensors ignored
    assert not hasattr(llm.llm_engine.runner.model, "mtp")
    assert greedy(llm) == expected


def test_a_checkpoint_without_mtp_tensors_is_refused(checkpoints):
    base, _, _, _ = checkpoints("qwen3")
    with pytest.raises(ValueError, match="declares no MTP layers"):
        LLM(base, dtype="float32", device="cpu", speculative=True)
