"""DeepSeek-V3.2 and GLM-5 tiny end to end with the Triton MLA backend on the indexer's sparse
selections: the engine runs the reference forward with its "mla" backend swapped for the Triton
one (its kernels run interpreted on the CPU tensors; the whole model interpreted would take
minutes), prompts longer than index_topk prefilled in 16-token chunks over the cached prefix and
decoded, a bf16 (here float32) and an fp8 latent cache: greedy tokens equal the all-reference
run's (the fp8 runs' each other's: both backends round the latents alike)."""

from __future__ import annotations

import random

import pytest

from dsa_checkpoints import INDEX_TOPK, make_dsa_checkpoint
from family_cases import family_fixtures
from metrale import LLM, SamplingParams
from metrale.layers.mla.triton_backend import TritonMLABackend

dsa_checkpoint, _expected = family_fixtures(make_dsa_checkpoint, "dsa_checkpoint")


def _generate(llm):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (3, INDEX_TOPK + 17)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family,kv_cache_dtype", [("deepseek_v32", "auto"), ("glm_moe_dsa", "auto"),
                                                   ("deepseek_v32", "fp8")])
def test_triton_mla_backend_on_sparse_selections_gives_the_references_tokens(dsa_checkpoint, family,
                                                                             kv_cache_dtype):
    path = dsa_checkpoint(family)
    engine_args = dict(dtype="float32", device="cpu", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16,
                       kv_cache_dtype=kv_cache_dtype)
    reference = _generate(LLM(path, **engine_args))
    llm = LLM(path, **engine_args)
    llm.llm_engine.runner.backends["mla"] = TritonMLABackend()  # the runner builds each step's metadata from it
    assert _generate(llm) == reference
