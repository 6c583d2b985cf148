"""vLLM-style offline code runs unchanged (issue 20): vLLM's option names, LLM.chat,
get_metrics, generation_config defaults, and an LLM that releases what it holds when closed or
deleted, so that a second engine (tp=2 included) starts in the same process."""

from __future__ import annotations

import gc
import json
import shutil

import pytest

from metrale import LLM, SamplingParams
from metrale.config.errors import OptionError
from parallel_cases import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_vllm_style_session_with_tp2_constructs_deletes_and_constructs_again(checkpoint_factory):
    path = checkpoint_factory("llama")
    prompts = ["Hello, world!", "The quick brown fox"]
    single = LLM(model=path, dtype="float32", device="cpu", seed=0, max_model_len=256, max_num_seqs=8,
                 gpu_memory_utilization=0.9, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    del single
    for _ in range(2):  # built, used and deleted twice: the groups and workers are released each time
        llm = LLM(model=path, dtype="float32", device="cpu", tensor_parallel_size=2, max_model_len=256,
                  enforce_eager=True, master_port=free_port())
        assert llm.llm_engine.executor.world_size == 2
        workers = [w.process for w in llm.llm_engine.executor.parallel.workers]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        del llm
        assert all(p.poll() is not None for p in workers), "a worker outlived its LLM"
    with LLM(model=path, dtype="float32", device="cpu", tensor_parallel_size=2, master_port=free_port()) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.closed
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(prompts, GREEDY)
    gc.collect()


def test_enable_expert_parallel_spreads_experts_over_the_tp_ranks():
    from metrale.config.engine_args import EngineArgs

    args = EngineArgs.from_kwargs(model="m", tensor_parallel_size=2, enable_expert_parallel=True)
    assert (args.tp_size, args.ep_size) == (2, 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline_parallel_size=2), "no pipeline parallelism"),
    (dict(trust_remote_code=True), "never runs code from a checkpoint"),
    (dict(tensor_parallel_size=2, tp_size=2), "name the same option"),
    (dict(swap_space=4), "unknown option"),
])
def test_vllm_options_met_does_not_take_are_clear_errors(kwargs, message):
    with pytest.raises(OptionError, match=message):
        LLM(model="demo", **kwargs)


def test_chat_and_metrics(checkpoint_factory):
    llm = LLM(model=checkpoint_factory("llama"), dtype="float32", device="cpu")
    conversation = [{"role": "user", "content": "Hello"}]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    by_hand = llm.generate({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)},
                           GREEDY, use_tqdm=False)[0]
    replies = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Hi"},
                                                      {"role": "user", "content": "Again"}]], GREEDY, use_tqdm=False)
    assert replies[0].outputs[0].token_ids == by_hand.outputs[0].token_ids
    assert replies[0].prompt_token_ids == by_hand.prompt_token_ids
    assert len(replies[1].prompt_token_ids) > len(replies[0].prompt_token_ids)
    metrics = {(m.name, tuple(m.labels.items())): m.value for m in llm.get_metrics()}
    assert metrics[("met:generation_tokens_total", ())] == 3 * 6
    assert metrics[("met:request_success_total", (("finished_reason", "length"),))] == 3
    assert metrics[("met:prompt_tokens_total", ())] == 2 * len(by_hand.prompt_token_ids) + len(
        replies[1].prompt_token_ids)
    assert metrics[("met:num_requests_running", ())] == 0


def test_generation_config_defaults_fill_what_a_request_leaves_unset(checkpoint_factory, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(checkpoint_factory("llama"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(dict(config, temperature=0.0, top_k=5,
                                                                 max_new_tokens=7)))
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 7)
    out = llm.generate(["Hello"], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 7
    assert LLM(model=str(path), dtype="float32", device="cpu", generation_config="vllm").llm_engine.sampling_defaults == {}
    with pytest.raises(OptionError, match="no generation_config.json"):
        LLM(model=str(path), dtype="float32", device="cpu", generation_config=str(tmp_path / "nowhere"))


def test_server_requests_take_generation_defaults_only_for_unset_fields():
    from metrale.entrypoints.server.protocol import ChatCompletionRequest

    defaults = {"temperature": 0.3, "top_k": 5, "max_tokens": 9}
    unset = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = unset.sampling_params(max_tokens=unset.resolved_max_tokens(), logprobs=None, max_n=4, vocab_size=100,
                                   defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 5, 9)
    given = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=1.0, max_tokens=3)
    params = given.sampling_params(max_tokens=given.resolved_max_tokens(), logprobs=None, max_n=4, vocab_size=100,
                                   defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 5, 3)


def test_lm_head_dtype_keeps_the_head_and_logits_in_float32(checkpoint_factory):
    import torch

    path = checkpoint_factory("llama3_tied")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    base = LLM(path, device="cpu", dtype="bfloat16")
    wide = LLM(path, device="cpu", dtype="bfloat16", lm_head_dtype="float32")
    model = wide.llm_engine.runner.model
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not model.tied_embeddings  # the head got its own float32 copy
    assert model.compute_logits(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)).dtype == torch.float32
    # the plan counts the extra copy
    assert wide.llm_engine.memory_plan.weight_bytes > base.llm_engine.memory_plan.weight_bytes
    out = wide.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6
