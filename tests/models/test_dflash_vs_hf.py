"""Speculative decoding with a tiny random DFlash drafter (tests/dflash_checkpoints.py), end to end:
greedy tokens identical to transformers' (Qwen3 and Llama targets) and to plain decoding (Llama),
batched prompts of mixed lengths; under chunked prefill with forced preemption, prefix hits and
tp=2 on the CPU. The drafts the runner proposes at every step equal the plain-torch reference's
for the same accepted tokens (so the drafter's context cache is right across chunks, rejected
rows and preemptions). A silent drafter whose drafts the target accepts shows the accept path.
Refusals: a missing drafter directory, a mismatched hidden size / vocabulary, target layers the
target lacks, k above the block size, keys the method does not take."""

from __future__ import annotations

import collections
import hashlib

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from dflash_checkpoints import (BLOCK_SIZE, assert_drafts_are_the_reference, constant_draft_mask, make_dflash_drafter,
                                make_dflash_target, record_drafts)
from metrale import LLM, SamplingParams
from speculative_cases import make_prompts

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Per family: (target dir, drafter dir, transformers' model, its greedy tokens per prompt)."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"dflash_{family}")
            target = make_dflash_target(str(root / "target"), family)
            drafter = make_dflash_drafter(str(root / "drafter"), target)
            model = load_reference(target)
            cache[family] = target, drafter, model, [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]
        return cache[family]

    return get


def engine(target: str, drafter: str | None, k: int = BLOCK_SIZE - 1, **kwargs) -> LLM:
    spec = {"speculative_config": {"method": "dflash", "model": drafter, "num_speculative_tokens": k}} if drafter else {}
    return LLM(target, dtype="float32", device="cpu", **spec, **kwargs)


def generate(llm: LLM, prompts=None):
    prompts = [{"prompt_token_ids": p} for p in (prompts or make_prompts())]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], [o.request_id for o in outputs]


def assert_idle(llm: LLM) -> None:
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0, stats
    kv = llm.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def sha256_as_stored(drafter: str) -> str:
    """The drafter tensors' sha256: in name order, each name, then its bytes."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(f"{drafter}/model.safetensors", "pt") as f:
        for name in sorted(f.keys()):
            digest.update(name.encode())
            digest.update(f.get_tensor(name).numpy().tobytes())
    return digest.hexdigest()


def test_greedy_matches_transformers_and_the_reference_drafts(setup):
    target, drafter, model, expected = setup("qwen3")
    llm = engine(target, drafter)
    calls = record_drafts(llm)
    tokens, ids = generate(llm)
    assert tokens == expected
    assert_idle(llm)
    assert_drafts_are_the_reference(calls, {rid: p + t for rid, p, t in zip(ids, make_prompts(), tokens)}, drafter,
                                    model)
    drafter_model = llm.llm_engine.runner.drafter.model
    assert llm.llm_engine.runner.drafter.sha256 == sha256_as_stored(drafter)
    # The memory plan counts the drafter: its weights, and its context K/V per token (2 layers x K
    # and V x 2 KV heads x head_dim 16 x 4 bytes) beside the target's (4 layers x 2 x 2 x 32 x 4).
    plan, target_model = llm.llm_engine.memory_plan, llm.llm_engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in target_model.parameters()}.values())
    assert plan.weight_bytes == weights + sum(p.numel() * 4 for p in drafter_model.parameters())
    assert plan.kv_bytes_per_token == 4 * 2 * 2 * 32 * 4 + 2 * 2 * 2 * 16 * 4


def test_plain_decoding_and_prefix_hits(setup):
    target, drafter, model, expected = setup("llama")
    assert generate(engine(target, None))[0] == expected
    llm = engine(target, drafter, block_size=8, enable_prefix_caching=True)
    assert generate(llm)[0] == expected
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    calls = record_drafts(llm)
    tokens, ids = generate(llm)  # the prompts again: their blocks, the drafter's context with them, are hits
    assert tokens == expected
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits
    assert_idle(llm)
    assert_drafts_are_the_reference(calls, {rid: p + t for rid, p, t in zip(ids, make_prompts(), tokens)}, drafter,
                                    model)


def test_chunked_prefill_and_preemption(setup):
    target, drafter, model, expected = setup("qwen3")
    # A 12-token budget chunks the long prompts beside the others' verify steps; 36 blocks of 4
    # tokens for ~280 tokens of requests force preemptions.
    llm = engine(target, drafter, max_num_batched_tokens=12, num_kv_blocks=36, block_size=4)
    calls = record_drafts(llm)
    tokens, ids = generate(llm)
    assert tokens == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_idle(llm)
    assert_drafts_are_the_reference(calls, {rid: p + t for rid, p, t in zip(ids, make_prompts(), tokens)}, drafter,
                                    model)


def test_accepted_drafts(setup, tmp_path):
    # A silent drafter drafts one token everywhere: the target's most frequent output token.
    target, _, model, expected = setup("qwen3")
    counts = collections.Counter(t for tokens in expected for t in tokens)
    token, mask = next((t, m) for t, _ in counts.most_common() if (m := constant_draft_mask(model, t)) is not None)
    drafter = make_dflash_drafter(str(tmp_path / "silent"), target, silent=True, mask_token_id=mask)
    llm = engine(target, drafter)
    assert generate(llm)[0] == expected
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0, (token, stats)
    assert_idle(llm)


def test_tensor_parallel_two_ranks(setup):
    target, drafter, _, expected = setup("qwen3")
    llm = engine(target, drafter, tp_size=2, max_num_batched_tokens=16)
    try:
        assert generate(llm)[0] == expected
        assert_idle(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("edit, message", [
    (dict(hidden_size=32), "hidden_size 32 does not match the target"),
    (dict(vocab_size=500), "vocab_size 500 does not match the target"),
    (dict(layer_ids=[0, 7]), r"target_layer_ids \[7\] are not layers 0..2"),
])
def test_mismatched_drafters_are_refused(setup, tmp_path, edit, message):
    target, _, _, _ = setup("qwen3")
    drafter = make_dflash_drafter(str(tmp_path / "bad"), target, **edit)
    with pytest.raises(ValueError, match=message):
        engine(target, drafter)


def test_command_line_and_refusals(setup, tmp_path):
    import argparse
    import json

    from metrale.config.engine_args import EngineArgs

    target, drafter, _, _ = setup("qwen3")
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", target, "--speculative-config", json.dumps({"method": "dflash", "model": drafter}),
         "--num-drafts", "2"]))
    spec = args.speculative_decoding
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("dflash", drafter, 2)
    with pytest.raises(ValueError, match="does not exist"):
        engine(target, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=f"num_speculative_tokens {BLOCK_SIZE} is above .* {BLOCK_SIZE - 1}"):
        engine(target, drafter, k=BLOCK_SIZE)
    with pytest.raises(ValueError, match="needs model"):
        LLM(target, dtype="float32", device="cpu", speculative_config={"method": "dflash", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown key"):
        LLM(target, dtype="float32", device="cpu",
            speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": 2, "block_size": 4})
    with pytest.raises(ValueError, match="model is read only by dflash"):
        LLM(target, dtype="float32", device="cpu",
            speculative_config={"method": "ngram", "model": drafter, "num_speculative_tokens": 2})
    assert torch.get_default_dtype() == torch.float32


def test_seeded_sampling_alone_equals_batched(setup):
    target, drafter, _, _ = setup("qwen3")
    llm = engine(target, drafter)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    params = [SamplingParams(temperature=0.8, top_k=40, seed=10 + i, max_tokens=NEW_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], [q], use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts[:3], params[:3])]
    assert batched[:3] == alone and all(len(t) == NEW_TOKENS for t in batched)
    assert_idle(llm)
