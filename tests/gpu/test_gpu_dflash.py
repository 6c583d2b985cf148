"""On the GPU: speculative decoding with a tiny random DFlash drafter (tests/dflash_checkpoints.py)
gives transformers' greedy tokens with the Triton backend (verify steps eager: a runner-side
drafter reads the step's hidden states), its drafts at every step are the plain-torch reference's,
and a silent drafter's drafts are accepted; bfloat16 runs."""

import collections

import pytest

from checkpoints import load_reference, reference_greedy
from dflash_checkpoints import (BLOCK_SIZE, assert_drafts_are_the_reference, constant_draft_mask, make_dflash_drafter,
                                make_dflash_target, record_drafts)
from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9] * 6, [20, 21, 22] * 10 + [23], [7, 3, 9, 11, 13, 2, 200], list(range(3, 120))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def run(target, drafter, dtype="float32", **kw):
    llm = LLM(target, dtype=dtype, device="cuda", num_kv_blocks=256, max_num_seqs=16,
              speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": BLOCK_SIZE - 1}, **kw)
    return llm


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dflash_on_the_gpu(family, tmp_path):
    target = make_dflash_target(str(tmp_path / "target"), family)
    drafter = make_dflash_drafter(str(tmp_path / "drafter"), target)
    model = load_reference(target)
    expected = [reference_greedy(model, p, 16) for p in PROMPTS]
    llm = run(target, drafter, attention_backend="triton")
    calls = record_drafts(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == expected
    assert_drafts_are_the_reference(calls, {o.request_id: p + t for o, p, t in zip(outputs, PROMPTS, tokens)},
                                    drafter, model)
    counts = collections.Counter(t for row in expected for t in row)
    mask = next(m for t, _ in counts.most_common() if (m := constant_draft_mask(model, t)) is not None)
    silent = make_dflash_drafter(str(tmp_path / "silent"), target, silent=True, mask_token_id=mask)
    llm = run(target, silent, attention_backend="triton")
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False)] == expected
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    bf16 = run(target, drafter, dtype="bfloat16")
    outs = bf16.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
