"""DeepSeek-V3.2 and GLM-5 (DSA) end to end on a GPU: the Triton MLA and indexer backends with
decode CUDA graphs give the PyTorch reference backends' greedy tokens and transformers' (run on
the CPU), in float32, with prompts longer than index_topk so the selection drops positions;
also with chunked prefill and with the fp8 indexer cache running."""

from __future__ import annotations

import random

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from dsa_checkpoints import INDEX_TOPK, make_dsa_checkpoint
from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu
NEW_TOKENS = 12


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 17, INDEX_TOPK + 40, 250)]


def _generate(path, **kw):
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=8, **kw)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_family_on_the_gpu_matches_the_references(family, tmp_path):
    path = make_dsa_checkpoint(str(tmp_path), family)
    llm, graphs = _generate(path, attention_backend="triton")
    runner = llm.llm_engine.runner
    assert runner.backends["mla"].name == "triton" and runner.backends["indexer"].name == "triton"
    assert runner.graphs is not None
    del llm
    torch.cuda.empty_cache()
    _, chunked = _generate(path, attention_backend="triton", max_num_batched_tokens=16)
    _, reference = _generate(path, attention_backend="torch", enforce_eager=True)
    model = load_reference(path)
    expected = [reference_greedy(model, p, NEW_TOKENS) for p in _prompts()]
    assert graphs == chunked == reference == expected


def test_fp8_indexer_cache_runs_on_the_gpu(tmp_path):
    path = make_dsa_checkpoint(str(tmp_path), "deepseek_v32")
    _, tokens = _generate(path, attention_backend="triton", indexer_cache_dtype="fp8")
    assert [len(t) for t in tokens] == [NEW_TOKENS] * len(_prompts())
