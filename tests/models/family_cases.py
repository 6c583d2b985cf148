"""What the per-family end-to-end tests against transformers share: a module's tiny checkpoints
and transformers' greedy tokens for the standard prompts (built once per module), the batched
run repeated on one engine so its prefixes hit the cache, and the check that a finished engine
holds no blocks."""

from __future__ import annotations

import pytest

from checkpoints import load_reference, reference_greedy
from metrale import LLM, SamplingParams
from test_generation_vs_hf import NEW_TOKENS, make_prompts


def family_fixtures(make_checkpoint, checkpoint_name: str, load=load_reference):
    """Module-scoped fixtures `checkpoint_name` (family -> path, via `make_checkpoint(dir, family)`)
    and `expected` (family -> transformers' greedy tokens for make_prompts(), from the model
    `load(path)` gives); assign both to names in the test module."""

    @pytest.fixture(scope="module", name=checkpoint_name)
    def checkpoint(tmp_path_factory):
        cache = {}

        def get(family):
            if family not in cache:
                cache[family] = make_checkpoint(str(tmp_path_factory.mktemp(f"ckpt_{family}")), family)
            return cache[family]

        return get

    @pytest.fixture(scope="module", name="expected")
    def expected(request):
        get_checkpoint, cache = request.getfixturevalue(checkpoint_name), {}

        def get(family):
            if family not in cache:
                model = load(get_checkpoint(family))
                cache[family] = [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]
            return cache[family]

        return get

    return checkpoint, expected


def generate_twice(path: str):
    """The standard prompts batched, then again on the same engine -> (llm, first tokens, second
    tokens, prefix hits before the second run)."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return llm, first, second, hits


def assert_idle(llm):
    kv = llm.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
