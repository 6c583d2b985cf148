"""DeepSeek-V3.2 and GLM-5 tiny end to end with the Triton indexer backend (under the CPU
interpreter) and every other kind on the PyTorch reference: greedy tokens equal the all-reference
run's for prompts longer than index_topk (sparse selections), prefilled in 16-token chunks over
the cached prefix and decoded, bf16 (here float32, the model dtype) and fp8 indexer caches. Only
the indexer's kernels run interpreted, which keeps this fast; the Triton MLA backend's own end
to end is tests/models/test_mla_triton_fp8.py."""

from __future__ import annotations

import random

import pytest

from dsa_checkpoints import INDEX_TOPK, make_dsa_checkpoint
from family_cases import family_fixtures
from metrale import LLM, SamplingParams
from metrale.layers.mla.indexer_triton_backend import TritonIndexerBackend

dsa_checkpoint, _expected = family_fixtures(make_dsa_checkpoint, "dsa_checkpoint")


def _prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (3, INDEX_TOPK + 17)]


def _generate(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family,indexer_cache_dtype", [("deepseek_v32", "auto"), ("deepseek_v32", "fp8"),
                                                        ("glm_moe_dsa", "fp8")])
def test_triton_indexer_tokens_equal_the_reference(dsa_checkpoint, family, indexer_cache_dtype):
    path = dsa_checkpoint(family)
    engine_args = dict(dtype="float32", device="cpu", block_size=8, num_kv_blocks=64,
                       indexer_cache_dtype=indexer_cache_dtype, max_num_batched_tokens=16)
    reference = _generate(LLM(path, **engine_args))
    llm = LLM(path, **engine_args)
    runner = llm.llm_engine.runner
    assert runner.backends["indexer"].name == "torch"
    runner.backends["indexer"] = TritonIndexerBackend()  # the runner builds each step's metadata from it
    assert _generate(llm) == reference
