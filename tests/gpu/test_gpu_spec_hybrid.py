"""On the GPU: speculative decoding (n-gram) on the hybrid families, Qwen3-Next and Qwen3.5, in
float32 on the Triton backends. Verify steps run eagerly (the linear-attention backends have no
verify graphs): the Triton verify kernel keeps the state after each draft, beside prefill chunks
after the chunked kernels (layers/linear_attention/draft_states.py). Greedy tokens with
speculation equal plain decoding's, with CUDA graphs off and on (decode graphs for the plain
steps), chunked, and on the PyTorch backends; drafts are accepted and rejected. (transformers'
tokens for the same checkpoints and prompts are checked on the CPU: test_speculative_hybrid.py.)

The checkpoints need transformers' Qwen3-Next / Qwen3.5 classes to be written; where the GPU
machine's transformers lacks them, write them elsewhere with
`PYTHONPATH=tests python tests/gpu/test_gpu_spec_hybrid.py DIR` and pass MET_SPEC_HYBRID_CHECKPOINTS=DIR.
"""

from __future__ import annotations

import os

import pytest
import transformers

from hybrid_checkpoints import HYBRID_FAMILIES, SPEC_INITIALIZER_RANGE, make_hybrid_checkpoint, spec_prompts
from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu
FAMILIES = ["qwen3_next", "qwen3_5"]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    def get(family):
        built = os.environ.get("MET_SPEC_HYBRID_CHECKPOINTS")
        if built and os.path.isdir(os.path.join(built, family)):
            return os.path.join(built, family)
        if not hasattr(transformers, HYBRID_FAMILIES[family][1]):
            pytest.fail(f"transformers {transformers.__version__} has no {HYBRID_FAMILIES[family][1]}: write the "
                        f"checkpoints where it does and pass MET_SPEC_HYBRID_CHECKPOINTS")
        return make_hybrid_checkpoint(str(tmp_path_factory.mktemp(family)), family,
                                      initializer_range=SPEC_INITIALIZER_RANGE)

    return get


def run(path, speculative=True, **kw):
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16,
              **({"speculative_config": SPEC} if speculative else {}), **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec_prompts()], GREEDY, use_tqdm=False)
    if speculative:
        stats = llm.llm_engine.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        assert llm.llm_engine.runner.verify_graphs is None  # verify steps eager: the path under test
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_equals_plain_decoding(family, checkpoint):
    path = checkpoint(family)
    _, plain = run(path, speculative=False, enforce_eager=True)
    llm, eager = run(path, enforce_eager=True)
    assert {b.name for b in llm.llm_engine.runner.backends.values()} == {"triton"}
    _, graphs = run(path)
    _, chunked = run(path, enforce_eager=True, max_num_batched_tokens=16)  # verifies beside prefill chunks
    _, torch_backend = run(path, attention_backend="torch", enforce_eager=True)
    assert eager == plain
    assert graphs == plain
    assert chunked == plain
    assert torch_backend == plain


if __name__ == "__main__":  # PYTHONPATH=tests python tests/gpu/test_gpu_spec_hybrid.py DIR
    import sys

    for name in FAMILIES:
        make_hybrid_checkpoint(os.path.join(sys.argv[1], name), name, initializer_range=SPEC_INITIALIZER_RANGE)
