"""The offline API's contract: order, prompt forms, validation, and `met generate`."""

import subprocess
import sys

import pytest

from metrale import LLM, SamplingParams
from metrale.messages.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return LLM(checkpoint_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=256)


def test_outputs_in_prompt_order_with_strings_and_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = ["Hello, world!", {"prompt_token_ids": [7, 8, 9]}, "The quick brown fox" * 5, {"prompt": "A paged"}]
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == ["Hello, world!", None, "The quick brown fox" * 5, "A paged"]
    assert outs[1].prompt_token_ids == [7, 8, 9]
    tok = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tok.encode("Hello, world!")
    for out in outs:
        assert out.finished and len(out.outputs[0].token_ids) == 5
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    alone = llm.generate(prompts[2], params)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_per_prompt_params_and_max_tokens_none(llm):
    outs = llm.generate([[5, 6], [5, 6]], [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                           SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)])
    assert len(outs[0].outputs[0].token_ids) == 2
    assert len(outs[1].outputs[0].token_ids) == 256 - 2


def test_context_overflow_and_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="maximum context length is 256 tokens") as e:
        llm.generate({"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=10))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate({"prompt_token_ids": [10**6]}, SamplingParams())
    # The engine is still usable, and nothing leaked.
    assert llm.generate([[5]], SamplingParams(max_tokens=1))[0].finished
    assert llm.llm_engine.scheduler.kv.num_free_blocks == llm.llm_engine.scheduler.kv.num_blocks


def test_met_generate_prints_completion(checkpoint_factory):
    path = checkpoint_factory("llama")
    run = subprocess.run([sys.executable, "-m", "metrale.entrypoints.cli", "generate", "--model", path,
                          "--prompt", "Hello, world!", "--max-tokens", "6", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    expected = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64).generate(
        "Hello, world!", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert run.stdout.rstrip("\n") == expected


def test_programmatic_launch_refused_where_it_does_not_exist(checkpoint_factory):
    """--programmatic-launch asks for a Hopper feature: on the CPU it is a clear error, and the
    default (None) leaves it off there."""
    from metrale import kernels

    with pytest.raises(ValueError, match="compute capability 9.0"):
        LLM(checkpoint_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=16, programmatic_launch=True)
    LLM(checkpoint_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=16)
    assert kernels.pdl_args() == {"PDL": False}
