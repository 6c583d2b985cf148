"""On the GPU, the hybrid linear-attention families (Qwen3-Next, Qwen3.5 dense and MoE): the
Triton backends, CUDA graphs, asynchronous scheduling, chunked prefill and prefix hits give the
same greedy tokens as the PyTorch backends and as transformers (float32, tiny checkpoints); in
bfloat16 the two backends agree by vLLM's top-5 rule, with a float32 or a bfloat16 recurrent
state.

transformers on the GPU machine may not know the newest families. Where it does not, the
checkpoint and transformers' tokens come from `python tests/hybrid_checkpoints.py DIR`, run where
it does, with MET_HYBRID_CHECKPOINTS=DIR: the reference stays transformers either way."""

from __future__ import annotations

import json
import os

import pytest
import transformers

from checkpoints import load_reference, reference_greedy
from hybrid_checkpoints import GPU_NEW_TOKENS, HYBRID_FAMILIES, gpu_prompts, make_hybrid_checkpoint
from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu
FAMILIES = sorted(HYBRID_FAMILIES)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(family):
        if family in cache:
            return cache[family]
        built = os.environ.get("MET_HYBRID_CHECKPOINTS")
        if built and os.path.isfile(os.path.join(built, family, "expected.json")):
            path = os.path.join(built, family)
            with open(os.path.join(path, "expected.json")) as f:
                cache[family] = path, json.load(f)
        elif hasattr(transformers, HYBRID_FAMILIES[family][1]):
            path = make_hybrid_checkpoint(str(tmp_path_factory.mktemp(family)), family)
            model = load_reference(path)
            cache[family] = path, [reference_greedy(model, p, GPU_NEW_TOKENS) for p in gpu_prompts()]
        else:
            pytest.fail(f"transformers {transformers.__version__} has no {HYBRID_FAMILIES[family][1]}: build the "
                        f"reference set where it does and pass MET_HYBRID_CHECKPOINTS")
        return cache[family]

    return get


def run(path, dtype="float32", **kw):
    llm = LLM(path, dtype=dtype, device="cuda", num_kv_blocks=256, max_num_seqs=16, **kw)
    params = SamplingParams(temperature=0, max_tokens=GPU_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in gpu_prompts()], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_graphs_eager_torch_and_transformers_agree(family, reference):
    path, expected = reference(family)
    llm, graphs = run(path)
    assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.async_scheduling
    assert {b.name for b in llm.llm_engine.runner.backends.values()} == {"triton"}
    _, eager = run(path, enforce_eager=True)
    _, synchronous = run(path, async_scheduling=False)
    _, torch_backend = run(path, attention_backend="torch", enforce_eager=True)
    _, chunked = run(path, max_num_batched_tokens=48)
    assert graphs == expected
    assert eager == expected
    assert synchronous == expected
    assert torch_backend == expected
    assert chunked == expected
    kv = llm.llm_engine.scheduler.kv
    hits = kv.prefix_hits_total
    params = SamplingParams(temperature=0, max_tokens=GPU_NEW_TOKENS, ignore_eos=True)
    again = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in gpu_prompts()], params,
                                                           use_tqdm=False)]
    assert again == expected and kv.prefix_hits_total > hits  # resumed from state checkpoints


BF16_STATE_NEXT = pytest.param(
    "qwen3_next", "bfloat16", marks=pytest.mark.xfail(strict=False, reason=(
        "known: the Triton chunked prefill keeps W, U and the per-chunk states in bf16 (about 1% relative error "
        "against the float32 reference), and with a bf16 recurrent state this tiny model's tokens diverged "
        "past the top-5 rule once on an H200 (2026-12-01)")))


@pytest.mark.parametrize("family,ssm_h_dtype", [("qwen3_next", "float32"), BF16_STATE_NEXT,
                                                ("qwen3_5", "float32"), ("qwen3_5", "bfloat16")])
def test_bf16_triton_close_to_torch_backend(family, ssm_h_dtype, reference):
    """bf16 is not bit-exact across kernels: vLLM's rule, each side's token in the other's top 5
    at the first divergence."""
    path, _ = reference(family)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)

    def go(backend):
        llm = LLM(path, dtype="bfloat16", device="cuda", num_kv_blocks=256, attention_backend=backend,
                  ssm_h_dtype=ssm_h_dtype)
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in gpu_prompts()], params,
                                                   use_tqdm=False)]

    for a, b in zip(go("triton"), go("torch")):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[i] and tb in a.logprobs[i]
                break
