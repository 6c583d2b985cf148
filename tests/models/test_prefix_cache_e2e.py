"""Greedy outputs identical with prefix caching on and off, for shared prefixes, after eviction."""

import random

from metrale import LLM, SamplingParams


def prompts_sharing_prefixes(seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(3, 384) for _ in range(200)]
    prompts = []
    for shared in (1, 15, 16, 17, 31, 32, 64, 100, 128, 199, 200):
        prompts.append(base[:shared] + [rng.randrange(3, 384) for _ in range(rng.randrange(0, 20))])
    return prompts


PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]


def test_on_equals_off_with_hits_and_eviction(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    prompts = prompts_sharing_prefixes()
    off = LLM(path, device="cpu", enable_prefix_caching=False, num_kv_blocks=80, block_size=16)
    on = LLM(path, device="cpu", enable_prefix_caching=True, num_kv_blocks=80, block_size=16)
    expected = run(off, prompts)
    # One at a time so later prompts hit what earlier ones cached, then all at once, twice.
    assert [run(on, [p])[0] for p in prompts] == expected
    assert run(on, prompts) == expected
    stats = on.llm_engine.scheduler.stats()
    assert stats.prefix_cache_hits_total > 0
    # Fill the pool with unrelated prompts to evict, then again.
    rng = random.Random(1)
    run(on, [[rng.randrange(3, 384) for _ in range(150)] for _ in range(8)])
    assert run(on, prompts) == expected
    kv = on.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_repeated_request_computes_a_single_token(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama"), device="cpu", num_kv_blocks=64, block_size=16)
    prompt = {"prompt_token_ids": list(range(10, 74))}  # 64 tokens: four full blocks
    first = llm.generate(prompt, PARAMS)[0].outputs[0].token_ids
    engine = llm.llm_engine
    computed = []
    execute = engine.runner.execute_async
    engine.runner.execute_async = lambda plan: (computed.append(plan.total_num_scheduled_tokens), execute(plan))[1]
    again = llm.generate(prompt, PARAMS)[0].outputs[0].token_ids
    assert again == first
    assert computed[0] == 1  # the prefill step: one token, for its logits
    assert sum(computed) == 1 + (PARAMS.max_tokens - 1)
