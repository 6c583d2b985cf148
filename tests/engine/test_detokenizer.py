"""Incremental detokenization never splits a character; stop strings end output and are not in it."""

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.detokenizer import IncrementalDetokenizer, find_stop


@pytest.fixture(scope="module")
def tokenizer(checkpoint_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_factory("llama"))


@pytest.mark.parametrize("text", ["Ünïcödé text, emoji 🙂 and CJK 漢字 must survive streaming.",
                                  "plain ascii words", "🙂🙂🙂 漢字漢字"])
def test_stream_pieces_are_whole_characters_and_join_to_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Hello, world!")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.step([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def _byte_level_char(b: int) -> str:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def test_byte_tokens_of_one_emoji_are_held_until_complete(tokenizer):
    byte_ids = [tokenizer.convert_tokens_to_ids(_byte_level_char(b)) for b in "🙂".encode()]
    assert len(byte_ids) == 4 and None not in byte_ids
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.step([i]) for i in byte_ids]
    assert pieces == ["", "", "", "🙂"]


def test_find_stop_looks_only_at_new_text():
    assert find_stop("abc STOP def", ["STOP"], new_chars=8) == (4, "STOP")
    assert find_stop("abc STOP def", ["STOP"], new_chars=3) is None
    assert find_stop("xxSTyy", ["ST", "xS"], new_chars=6) == (1, "xS")


def test_stop_strings_end_output_without_appearing(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=128)
    prompt = {"prompt_token_ids": list(range(40, 90))}
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
