"""Speculative decoding with the n-gram drafter on one engine: prefix hits, seeded sampled
requests identical alone and batched, n = 2, the metrics, tp=2 on the CPU (hybrid models:
test_speculative_hybrid.py)."""

from __future__ import annotations

import pytest

from metrale import SamplingParams
from speculative_cases import (assert_accepted_and_idle, checkpoint, engine, expected, greedy,  # noqa: F401
                               make_prompts)


@pytest.mark.parametrize("family", ["llama"])
def test_prefix_hits(family, checkpoint, expected):
    llm = engine(checkpoint(family), block_size=8, enable_prefix_caching=True)
    assert greedy(llm) == expected(family)
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    assert greedy(llm) == expected(family)
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits
    assert_accepted_and_idle(llm)


def test_seeded_sampling_alone_equals_batched_and_metrics(checkpoint):
    llm = engine(checkpoint("llama"))
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=10 + i,
                             max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], [q], use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert batched == alone
    # n = 2: two children, each its own stream; each still gives its tokens alone.
    pair = llm.generate([prompts[4]], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    assert len(pair) == 2 and all(len(c.token_ids) == 16 for c in pair)
    metrics = {(m.name, m.labels.get("position")): m.value for m in llm.get_metrics()}
    stats = llm.llm_engine.scheduler.spec_stats
    assert metrics[("met:spec_decode_num_drafts_total", None)] == stats.num_drafts > 0
    assert metrics[("met:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert metrics[("met:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    assert metrics[("met:spec_decode_num_accepted_tokens_per_pos_total", "0")] == stats.accepted_per_position[0]
    # Generated tokens count what requests received, never a rejected draft.
    assert metrics[("met:generation_tokens_total", None)] == sum(map(len, batched + alone)) + 32


def test_tensor_parallel_two_ranks(checkpoint, expected):
    llm = engine(checkpoint("qwen3"), tp_size=2, max_num_batched_tokens=16)
    try:
        assert greedy(llm) == expected("qwen3")
        assert_accepted_and_idle(llm)
    finally:
        llm.close()


def test_stops_inside_a_verify_step_end_where_plain_decoding_ends(checkpoint, expected):
    # The shortest prompt's continuation repeats a token (drafts accepted from its 6th token on);
    # cut it by a stop token id and by a stop string from after that run: with speculation, the
    # output ends at the same token, with the same text, as without.
    path = checkpoint("llama")
    prompt, tokens = make_prompts()[0], expected("llama")[0]
    llm, plain = engine(path), engine(path, speculative=False)
    stop_id = tokens[9]
    assert stop_id not in tokens[:9]
    tokenizer = llm.get_tokenizer()
    start = len(tokenizer.decode(tokens[:8]))
    stop_text = tokenizer.decode(tokens)[start:start + 2]
    for params in (SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
                   SamplingParams(temperature=0, max_tokens=24, stop=[stop_text])):
        ours = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        theirs = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert (ours.token_ids, ours.text, ours.finish_reason) == (theirs.token_ids, theirs.text, theirs.finish_reason)
        assert len(ours.token_ids) < 24 and ours.finish_reason == "stop"
    assert_accepted_and_idle(llm)


def test_logprobs_of_drafted_requests_are_their_positions_logprobs(checkpoint, expected):
    # Requests asking for logprobs are drafted too: every token a verify step gives (accepted
    # drafts and the sampled one) carries the raw logprobs of its own position. Greedy: the same
    # tokens and logprobs as plain decoding. Sampled (tokens differ from plain sampling's stream):
    # each token's logprob and top-2 against transformers' forward over prompt + output.
    import torch

    from checkpoints import load_reference

    path = checkpoint("llama")
    llm, plain = engine(path), engine(path, speculative=False)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    greedy_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    ours = [o.outputs[0] for o in llm.generate(prompts, greedy_params, use_tqdm=False)]
    theirs = [o.outputs[0] for o in plain.generate(prompts, greedy_params, use_tqdm=False)]
    assert [a.token_ids for a in ours] == expected("llama")
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank for t in x)
    drafted = llm.llm_engine.scheduler.spec_stats.num_accepted_tokens
    assert drafted > 0
    sampled = SamplingParams(temperature=0.3, top_k=50, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)
    model = load_reference(path)
    for prompt, out in zip(make_prompts(), (o.outputs[0] for o in llm.generate(prompts, sampled, use_tqdm=False))):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
        reference = logits.float().log_softmax(-1)
        assert len(out.logprobs) == len(out.token_ids)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(entry[token].logprob - float(reference[j, token])) < 1e-4
            top = reference[j].topk(2)
            assert all(abs(entry[int(t)].logprob - float(v)) < 1e-4 for v, t in zip(top.values, top.indices))
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > drafted  # the sampled run drafted too
    assert_accepted_and_idle(llm)
