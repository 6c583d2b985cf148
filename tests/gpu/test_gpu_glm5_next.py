"""GLM-5.3 tiny (tests/glm5_next_checkpoints.py) on a GPU: the PyTorch backends of every kind
(the only ones that run NoPE MLA, the pooled indexer and KDA), eager, in float32, give
transformers' greedy tokens (computed on the CPU), also chunked; bfloat16 runs to the end. The
default backends refuse by name (the Triton MLA kernels assume a rope part). Needs a
transformers that knows glm5_next (5.24+); skipped where it does not."""

from __future__ import annotations

import random

import pytest
import torch

from glm5_next_checkpoints import INDEX_TOPK, load_glm5_next_reference, make_glm5_next_checkpoint
from checkpoints import reference_greedy
from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers.models.glm5_next")
NEW_TOKENS = 12


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 17, INDEX_TOPK + 40, 250)]


def _generate(path, **kw):
    llm = LLM(path, device="cuda", num_kv_blocks=256, max_num_seqs=8, attention_backend="torch", **kw)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_glm5_next_on_the_gpu_matches_transformers(tmp_path):
    path = make_glm5_next_checkpoint(str(tmp_path))
    llm, tokens = _generate(path, dtype="float32")
    assert llm.llm_engine.runner.graphs is None  # the KDA and pooled indexer backends have no graphs
    del llm
    torch.cuda.empty_cache()
    _, chunked = _generate(path, dtype="float32", max_num_batched_tokens=16)
    model = load_glm5_next_reference(path)
    expected = [reference_greedy(model, p, NEW_TOKENS) for p in _prompts()]
    assert tokens == chunked == expected
    _, bf16 = _generate(path, dtype="bfloat16")
    assert [len(t) for t in bf16] == [NEW_TOKENS] * len(_prompts())


def test_glm5_next_default_backends_refuse_by_name(tmp_path):
    path = make_glm5_next_checkpoint(str(tmp_path))
    with pytest.raises(Exception, match="MLA without RoPE .* --attention-backend torch"):
        LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=8).generate(
            [{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
