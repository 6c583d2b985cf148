"""A soak of random requests with random aborts, n > 1 and stop strings: nothing hangs, every
request ends, and at idle every KV block is free again (reliability cases 4, 22, 23)."""

import random

import pytest
import torch

from metrale.engine.engine import LLMEngine
from metrale.startup import build_llm_engine
from metrale.config.engine_args import EngineArgs
from metrale.messages.sampling_params import SamplingParams


def soak(engine: LLMEngine, steps: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    live: set[str] = set()
    counts = {"added": 0, "aborted": 0, "finished": 0}
    next_id = 0
    for _ in range(steps):
        for _ in range(rng.randrange(0, 3)):
            params = SamplingParams(n=rng.choice([1, 1, 2, 3]), temperature=rng.choice([0.0, 0.7, 1.0]),
                                    top_p=rng.choice([1.0, 0.9]), max_tokens=rng.randrange(1, 40),
                                    seed=rng.choice([None, rng.randrange(100)]), stop=rng.choice([None, ["ab"]]),
                                    ignore_eos=rng.random() < 0.5)
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
            engine.add_request(str(next_id), {"prompt_token_ids": prompt}, params)
            live.add(str(next_id))
            next_id += 1
            counts["added"] += 1
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
            counts["aborted"] += 1
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                counts["finished"] += 1
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                counts["finished"] += 1
    assert not engine.has_unfinished_requests(), "requests still running after the soak: a hang"
    assert not live, f"requests that never reported finishing: {sorted(live)[:5]}"
    engine.step()  # the runner drops the last finished requests' state
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.runner.requests and not engine.scheduler.requests
    assert not engine.outputs.parents and not engine.outputs.child_to_parent
    return counts


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_soak_with_random_aborts_returns_every_block(checkpoint_factory, prefix_caching):
    # A small pool, so preemption happens too.
    engine = build_llm_engine(EngineArgs(model=checkpoint_factory("llama"), device="cpu", num_kv_blocks=48, block_size=8,
                                  max_num_batched_tokens=64, enable_prefix_caching=prefix_caching))
    counts = soak(engine, steps=80)
    assert counts["added"] > 30 and counts["aborted"] > 3
    assert counts["added"] == counts["aborted"] + counts["finished"]
    assert engine.scheduler.num_preemptions_total > 0


@pytest.mark.gpu
def test_soak_on_gpu(checkpoint_factory):
    engine = build_llm_engine(EngineArgs(model=checkpoint_factory("qwen3"), device="cuda", dtype="bfloat16",
                                  num_kv_blocks=64, block_size=16, max_num_batched_tokens=128, max_num_seqs=16))
    assert engine.runner.graphs is not None
    counts = soak(engine, steps=400, seed=1)
    assert counts["added"] == counts["aborted"] + counts["finished"]
    torch.cuda.synchronize()
