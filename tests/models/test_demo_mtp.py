"""The built-in demo model's trained MTP layer (metrale/demo_model/mtp.safetensors, met's dense
`mtp.*` layout, scripts/train_demo_mtp.py, docs/demo_model.md):

- MTP drafting on a few of its documentation prompts gives plain greedy's tokens, with most drafts
  accepted: k = 1 (the default for the dense layout) and chained k = 2, acceptance above bounds
  well under what was measured (0.78 and 0.58 over 8 prompts x 128 tokens);
- met loads the weights from the separate file (every *.safetensors in the folder) and hashes
  them as stored; transformers' from_pretrained of the folder never sees them (no unexpected keys,
  no `mtp.*` parameter), though config.json declares `num_nextn_predict_layers: 1`.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config.demo_model import demo_model_dir

QUESTIONS = ["What is the assert statement?", "What does json.dumps do?", "How do I use yield in Python?", "Hello"]
GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir())
    return [{"prompt_token_ids": list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                                   add_generation_prompt=True, tokenize=True,
                                                                   return_dict=True)["input_ids"])}
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain_tokens(prompts):
    llm = LLM(demo_model_dir(), dtype="float32", device="cpu")
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("k, min_acceptance", [(None, 0.6), (2, 0.4)])
def test_mtp_drafts_are_lossless_and_mostly_accepted(prompts, plain_tokens, k, min_acceptance):
    spec = {"method": "mtp"} if k is None else {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(demo_model_dir(), dtype="float32", device="cpu", speculative_config=spec)
    assert llm.llm_engine.runner.drafter.k == (k or 1)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert tokens == plain_tokens
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 50
    assert stats.acceptance_rate > min_acceptance, stats
    assert stats.mean_accepted_length > 1 + (k or 1) * min_acceptance, stats


def test_mtp_drafted_requests_get_plain_decodings_logprobs(prompts):
    # chained MTP drafts (k = 2) for requests that ask for logprobs: each accepted draft and each
    # sampled token carries its own position's logprobs, as plain decoding reports them
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    plain = LLM(demo_model_dir(), dtype="float32", device="cpu")
    llm = LLM(demo_model_dir(), dtype="float32", device="cpu", speculative_config={"method": "mtp",
                                                                                   "num_speculative_tokens": 2})
    theirs = [o.outputs[0] for o in plain.generate(prompts[:2], params, use_tqdm=False)]
    ours = [o.outputs[0] for o in llm.generate(prompts[:2], params, use_tqdm=False)]
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 10
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank for t in x)


def test_the_mtp_weights_are_met_s_alone(prompts):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = os.path.join(demo_model_dir(), "mtp.safetensors")
    digest = hashlib.sha256()
    with safe_open(path, "pt") as f:
        names = sorted(f.keys())
        for name in names:
            digest.update(name.encode())
            digest.update(f.get_tensor(name).contiguous().view(-1).view(torch.uint8).numpy().tobytes())  # bf16
    assert names and all(name.startswith("mtp.") for name in names)
    model = LLM(demo_model_dir(), dtype="float32", device="cpu").llm_engine.runner.model
    assert model.mtp_sha256 == digest.hexdigest() and model.mtp_tensor_count == len(names) == 13
    reference, info = AutoModelForCausalLM.from_pretrained(demo_model_dir(), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert reference.config.num_nextn_predict_layers == 1
    assert not any(name.startswith("mtp") for name in reference.state_dict())
