"""Structured outputs on the GPU: the bitmask kernel at a real vocabulary against its reference,
and constrained generation with CUDA graphs and asynchronous scheduling (the CUDA defaults)
following its grammar, leaving free rows of the batch untouched, and drawing the same tokens
as with synchronous scheduling."""

import json
import os
import sys

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.kernels import reference
from metrale.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_triton
from metrale.messages.structured_outputs import StructuredOutputsParams as Spec

pytestmark = pytest.mark.gpu
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["x", "y", "z"]},
                         "code": {"type": "string", "pattern": "^[a-z]{2,5}$"}},
          "required": ["n", "tag", "code"], "additionalProperties": False}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows,constrained", [(1, [0]), (256, list(range(0, 256, 3))), (8, [7, 0, 3])])
def test_bitmask_kernel_at_qwen_vocabulary(dtype, num_rows, constrained):
    vocab = 151_936
    g = torch.Generator(device="cuda").manual_seed(num_rows)
    logits = torch.randn(num_rows, vocab, device="cuda", generator=g).to(dtype)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(constrained), words), device="cuda", dtype=torch.int64,
                            generator=g).to(torch.int32)
    rows = torch.tensor(constrained, device="cuda")
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, rows)
    apply_token_bitmask_triton(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    apply_token_bitmask(expected, bitmask, rows)  # the dispatcher takes the kernel on CUDA; applying twice is a no-op
    assert torch.equal(logits, expected)


def _generate(llm, batch):
    outs = llm.generate([p for p, _ in batch], [q for _, q in batch], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_constrained_generation_with_graphs_and_async_scheduling(checkpoint_factory):
    path = checkpoint_factory("llama")
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=32)
    assert llm.llm_engine.async_scheduling and llm.llm_engine.runner.graphs is not None
    constrained = [("Hello, world!", SamplingParams(temperature=1.0, seed=s, max_tokens=200,
                                                    structured_outputs=Spec(json=SCHEMA))) for s in range(16)]
    free = [(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            for p in ("The quick brown fox", "A paged KV cache")]
    alone = _generate(llm, free)
    outputs = _generate(llm, free[:1] + constrained + free[1:])
    assert [outputs[0].token_ids, outputs[-1].token_ids] == [o.token_ids for o in alone]
    for out in outputs[1:-1]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    synchronous = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=32,
                      async_scheduling=False)
    assert [o.text for o in _generate(synchronous, constrained)] == [o.text for o in outputs[1:-1]]


def test_drafted_constrained_requests_on_verify_graphs(checkpoint_factory):
    """Prompt-lookup drafts for constrained requests: their verify rows masked by the kernel over
    the drafts, on the verify graphs; greedy tokens equal the plain engine's, drafts accepted. The
    batch is the CPU test's (tests/structured/test_speculative_constrained.py): prompts that hold
    the text their grammars force, so some drafts are accepted whatever the random weights pick
    (a regex and a schema of this file's alone drew 2 drafts, none accepted, on an H100)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "structured"))
    from test_speculative_constrained import NGRAM, _batch

    path = checkpoint_factory("llama")
    batch = _batch(temperature=0)
    plain = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=32)
    expected = [o.token_ids for o in _generate(plain, batch)]
    del plain
    for async_scheduling in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=32,
                  async_scheduling=async_scheduling, speculative_config=NGRAM)
        assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.runner.verify_graphs is not None
        assert [o.token_ids for o in _generate(llm, batch)] == expected, async_scheduling
        stats = llm.llm_engine.scheduler.spec_stats
        assert stats.num_accepted_tokens > 0, (async_scheduling, stats)
