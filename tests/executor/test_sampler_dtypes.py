"""The sampler takes the LM head's logits in the model dtype: the tokens (greedy, seeded with
filters, with penalties) and logprobs are those of the fp32 widening of the same logits."""

import torch

from metrale.messages.sampling_params import SamplingParams
from metrale.executor.sampler import SamplingRow, sample


def test_half_precision_logits_sample_like_their_fp32_widening():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 300, generator=g) * 4).to(torch.bfloat16)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.1, logprobs=3),
              SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={7: 5.0}),
              SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.2)]
    rows = [SamplingRow(p, seed=100 + i, token_ids=[1, 7, 7, 9], num_prompt_tokens=2) for i, p in enumerate(params)]
    half_tokens, half_lp = sample(logits, rows)
    wide_tokens, wide_lp = sample(logits.float(), rows)
    assert half_tokens == wide_tokens
    assert half_lp[2] == wide_lp[2] and half_lp[2] is not None
    assert logits.dtype == torch.bfloat16  # the caller's logits are not modified
