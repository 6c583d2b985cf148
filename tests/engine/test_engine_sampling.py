"""Sampling: seeds, batch invariance, n > 1, filters, penalties and logprobs."""

import math

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.messages.sampling_params import SamplingParamsError
from metrale.executor.sampler import SamplingRow, _filter, sample


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return LLM(checkpoint_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=256)


PROMPTS = [[5, 6, 7, 8], list(range(20, 70)), [9]]


def test_same_seed_same_tokens_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPTS[1]}, params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]},
                          {"prompt_token_ids": PROMPTS[2]}], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate({"prompt_token_ids": PROMPTS[1]}, params)[0].outputs[0].token_ids
    assert again == alone


def test_different_seeds_differ(llm):
    outs = [llm.generate({"prompt_token_ids": PROMPTS[1]},
                         SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True))[0]
            for s in (1, 2)]
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_n_gives_n_distinct_outputs(llm):
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3


def test_greedy_with_n_and_logprobs(llm, checkpoint_factory):
    from checkpoints import load_reference

    out = llm.generate({"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    model = load_reference(checkpoint_factory("llama"))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1] + out.token_ids])).logits[0]
    expected = logits.log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = expected[len(PROMPTS[1]) - 1 + step]
        assert next(iter(entry)) == token and entry[token].rank == 1
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        top = row.topk(3).indices.tolist()
        assert list(entry)[:3] == top or set(entry) == set(top)
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                        rel_tol=1e-6)


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=8))[0]
    topk1 = llm.generate({"prompt_token_ids": PROMPTS[1]},
                         SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=8))[0]
    assert greedy.outputs[0].token_ids == topk1.outputs[0].token_ids


def _row(**kw):
    return SamplingRow(SamplingParams(**kw), seed=0, token_ids=[], num_prompt_tokens=0)


def test_filters_keep_expected_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    rows = [_row(top_k=2), _row(top_p=0.7), _row(min_p=0.25)]
    kept = (_filter(logits, rows) > float("-inf")).tolist()
    assert kept[0] == [True, True, False, False]
    assert kept[1] == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert kept[2] == [True, True, True, False]  # >= 0.25 * 0.5


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    rows = [SamplingRow(SamplingParams(temperature=1.0), seed=s, token_ids=[], num_prompt_tokens=0)
            for s in range(3000)]
    tokens, _ = sample(probs.log().repeat(3000, 1), rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_penalties_and_min_tokens():
    logits = torch.tensor([[2.0, 1.5, 0.5, -1.0]])

    def greedy(prompt, output, **kw):
        row = SamplingRow(SamplingParams(temperature=0, **kw), 0, prompt + output, len(prompt))
        return sample(logits, [row])[0][0]

    assert greedy([0], [], repetition_penalty=1.2) == 0  # 2.0 / 1.2 = 1.67 still beats 1.5
    assert greedy([0], [], repetition_penalty=1.6) == 1  # 2.0 / 1.6 = 1.25 loses
    assert greedy([], [0], repetition_penalty=1.6) == 1  # outputs count too
    assert greedy([], [0], frequency_penalty=0.3) == 0
    assert greedy([], [0, 0], frequency_penalty=0.3) == 1  # 2.0 - 2 * 0.3 = 1.4
    assert greedy([], [0, 0], presence_penalty=0.6) == 1  # once, whatever the count
    assert greedy([], [0, 0], presence_penalty=0.4) == 0
    assert greedy([], [3], min_tokens=2, eos_token_ids=[0]) == 1  # EOS banned until 2 outputs
    assert greedy([], [3, 3], min_tokens=2, eos_token_ids=[0]) == 0


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 1.5), ("top_p", 0), ("top_k", 0.5),
                                         ("n", 0), ("max_tokens", 0), ("max_tokens", -1), ("logprobs", 21),
                                         ("min_p", 2), ("presence_penalty", 3), ("stop", [""]),
                                         ("stop", ["x"] * 17), ("seed", 2**64)])
def test_bad_params_name_their_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_logit_bias_forces_and_bans_tokens(llm):
    prompt = {"prompt_token_ids": PROMPTS[1]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                 logit_bias={7: 100.0}))[0].outputs[0]
    assert forced.token_ids == [7, 7, 7, 7]
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                 logit_bias={greedy.token_ids[0]: -100.0}))[0].outputs[0]
    assert banned.token_ids[0] != greedy.token_ids[0]
    sampled = llm.generate(prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                                                  logit_bias={9: 100.0}))[0].outputs[0]
    assert sampled.token_ids == [9] * 6


def test_logit_bias_is_validated(llm):
    from metrale.messages.errors import InvalidRequestError

    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={1: 1e9})
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(logit_bias={10**6: 1.0}))
