"""Tensor and expert parallel on two or more GPUs, over NCCL (NVLink multicast off), with CUDA
graphs capturing the collectives.

- Tiny checkpoints: greedy ids at tp=2 / ep=2 / tp=ep=2 equal transformers' (float32), with
  chunked prefill and graph-replayed decode steps in one run.
- Real shapes with dummy weights: the Qwen3-8B config at tp=2 and the Qwen3-30B-A3B config (16
  of its 48 layers, so one GPU holds it in float32) at ep=2 and tp=2 give the greedy ids of one
  GPU; dummy weights are the same full tensors on any layout (`loader/weights.dummy_checkpoint`).
  float32, so that the only difference between layouts is the order of additions.
"""

from __future__ import annotations

import functools
import gc
import random

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from metrale import LLM, SamplingParams
from parallel_cases import build_checkpoint, free_port, make_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs")]

NEW_TOKENS = 12

# Each case starts a worker process (~15 s): one case per way of splitting.
TINY_CASES = [
    ("qwen3", dict(tp_size=2)),
    ("llama_kv1", dict(tp_size=2)),  # one KV head, replicated
    ("qwen3_moe", dict(tp_size=2, ep_size=2, moe_expert_layout="tp")),
    ("minimax_m2_uneven", dict(ep_size=2)),  # 5 experts over 2 ranks
]


def greedy_ids(llm: LLM, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def split_run(path: str, prompts, new_tokens: int = NEW_TOKENS, **kw) -> list[list[int]]:
    llm = LLM(path, device="cuda", master_port=free_port(), **kw)
    try:
        assert llm.llm_engine.executor.world_size == 2
        return greedy_ids(llm, prompts, new_tokens)
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("name, sizes", TINY_CASES,
                         ids=[f"{n}-" + "-".join(f"{k}{v}" for k, v in s.items()) for n, s in TINY_CASES])
def test_tiny_checkpoints_on_nccl_match_transformers(name, sizes, tmp_path):
    path = build_checkpoint(name, str(tmp_path))
    model = load_reference(path)
    expected = [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]
    # A 16-token step budget: prompts prefill in chunks beside decodes; once they are all in,
    # decode steps replay CUDA graphs that hold the collectives.
    assert split_run(path, make_prompts(), dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                     max_num_batched_tokens=16, **sizes) == expected


def dummy_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10000) for _ in range(rng.randint(8, 300))] for _ in range(count)]


def one_gpu_run(model: str, prompts, new_tokens: int, **kw) -> list[list[int]]:
    llm = LLM(model, device="cuda", **kw)
    try:
        assert llm.llm_engine.runner.graphs is not None
        return greedy_ids(llm, prompts, new_tokens)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


DUMMY = dict(load_format="dummy", dtype="float32", skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=8,
             gpu_memory_utilization=0.85)


def test_qwen3_8b_at_tp2_gives_one_gpus_tokens():
    prompts = dummy_prompts(6, seed=1)
    one = one_gpu_run("Qwen3-8B", prompts, 32, **DUMMY)
    assert len({tuple(t) for t in one}) > 1
    assert split_run("Qwen3-8B", prompts, 32, tp_size=2, **DUMMY) == one
    # The one-shot symmetric-memory all-reduce for messages up to 64 KiB (every decode step's).
    assert split_run("Qwen3-8B", prompts, 32, tp_size=2, all_reduce_oneshot_max_kb=64, **DUMMY) == one


MOE_DUMMY = dict(DUMMY, hf_overrides={"num_hidden_layers": 16})


@functools.cache
def moe_one_gpu() -> list[list[int]]:
    return one_gpu_run("Qwen3-30B-A3B", dummy_prompts(6, seed=2), 24, **MOE_DUMMY)


@pytest.mark.parametrize("sizes", [dict(ep_size=2), dict(tp_size=2)], ids=["ep2", "tp2"])
def test_qwen3_30b_a3b_split_gives_one_gpus_tokens(sizes):
    one = moe_one_gpu()
    assert len({tuple(t) for t in one}) > 1
    assert split_run("Qwen3-30B-A3B", dummy_prompts(6, seed=2), 24, **sizes, **MOE_DUMMY) == one
