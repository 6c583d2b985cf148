"""Asynchronous scheduling (step N+1 planned and launched before step N's tokens are read back)
changes no output: the same tokens as transformers and as the synchronous engine, with chunked
prefill, preemption, prefix caching, seeds, n, stop strings, EOS, penalties and aborts."""

import random

import pytest

from checkpoints import load_reference, reference_greedy
from metrale import LLM, SamplingParams
from metrale.config.engine_args import EngineArgs
from metrale.startup import build_llm_engine

LENGTHS = [1, 3, 17, 64, 100, 181, 250]


def prompts(seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in LENGTHS]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16},
                                           {"num_kv_blocks": 70, "block_size": 4, "max_num_batched_tokens": 32}])
def test_greedy_matches_transformers(family, engine_kwargs, checkpoint_factory):
    path = checkpoint_factory(family)
    model = load_reference(path)
    expected = [reference_greedy(model, p["prompt_token_ids"], 12) for p in prompts()]
    llm = LLM(path, device="cpu", async_scheduling=True, **engine_kwargs)
    assert llm.llm_engine.async_scheduling
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "num_kv_blocks" in engine_kwargs:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    kv = llm.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_default_is_synchronous_on_the_cpu(checkpoint_factory):
    """Nothing to overlap on the CPU (the host runs the model); the default turns on with CUDA."""
    path = checkpoint_factory("llama")
    assert not LLM(path, device="cpu").llm_engine.async_scheduling
    assert not LLM(path, device="cpu", async_scheduling=False).llm_engine.async_scheduling


def test_same_outputs_as_synchronous_for_every_kind_of_request(checkpoint_factory):
    path = checkpoint_factory("llama")
    sync = LLM(path, device="cpu", num_kv_blocks=128)
    overlap = LLM(path, device="cpu", num_kv_blocks=128, async_scheduling=True)
    eos = sync.llm_engine.eos_token_ids[0]
    text = sync.generate(prompts()[4], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, stop=[text[5:8]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, logit_bias={eos: 8.0}),  # stops on EOS early
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.5, max_tokens=None, seed=1, ignore_eos=True),
    ]

    def run(llm):
        outs = llm.generate(prompts()[:len(params)], params)
        return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason,
                  [sorted(lp.items()) for lp in o.logprobs] if o.logprobs else None) for o in r.outputs]
                for r in outs]

    expected = run(sync)
    assert expected[3][0][2] == "stop"  # the EOS case did stop early
    assert run(overlap) == expected


def test_soak_with_aborts_leaves_nothing_behind(checkpoint_factory):
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        "engine_soak", os.path.join(os.path.dirname(__file__), "..", "engine", "test_soak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    soak = module.soak

    engine = build_llm_engine(EngineArgs(model=checkpoint_factory("llama"), device="cpu", num_kv_blocks=48, block_size=8,
                                  max_num_batched_tokens=64, async_scheduling=True))
    counts = soak(engine, steps=80, seed=2)
    assert counts["added"] == counts["aborted"] + counts["finished"]


def test_prefix_cache_hits_under_async_scheduling(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    sync = LLM(path, device="cpu", num_kv_blocks=80)
    overlap = LLM(path, device="cpu", num_kv_blocks=80, async_scheduling=True)
    base = prompts()[6]["prompt_token_ids"]
    shared = [{"prompt_token_ids": base[:n] + [7, 8, 9][: n % 3]} for n in (16, 32, 33, 64, 100, 200)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in sync.generate(shared, params)]
    assert [overlap.generate(p, params)[0].outputs[0].token_ids for p in shared] == expected
    assert overlap.llm_engine.scheduler.stats().prefix_cache_hits_total > 0
