"""The server's prompt bounds (metrale/entrypoints/server/prompts.py), without a server."""

from __future__ import annotations

import asyncio

import pytest

from metrale.config.demo_model import demo_model_dir
from metrale.entrypoints.server import prompts as prompts_module
from metrale.entrypoints.server.errors import APIError
from metrale.entrypoints.server.prompts import PromptRenderer


@pytest.fixture(scope="module")
def renderer():
    r = PromptRenderer.load(demo_model_dir(), vocab_size=4096, max_model_len=2048)
    yield r
    r.close()


def test_character_bound_is_the_context_times_the_longest_token(renderer):
    longest = max(len(t) for t in renderer.tokenizer.get_vocab())
    assert renderer.max_prompt_chars == 2048 * longest
    with pytest.raises(APIError) as refused:
        asyncio.run(renderer.encode("x" * (renderer.max_prompt_chars + 1)))
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert "characters" in refused.value.message


def test_long_text_is_counted_in_pieces_and_refused_before_it_is_tokenized_whole(renderer, monkeypatch):
    monkeypatch.setattr(prompts_module, "PIECE_CHARS", 4096)
    renderer_tokenizer = renderer._lanes[1].tokenizer
    seen: list[int] = []
    original = renderer_tokenizer.encode

    def spy(text, **kwargs):
        seen.append(len(text))
        return original(text, **kwargs)

    monkeypatch.setattr(renderer_tokenizer, "encode", spy)
    text = "hello world again " * 10_000  # 180,000 characters, tens of thousands of tokens
    monkeypatch.setattr(renderer, "max_prompt_chars", 10**9)  # past the cheap bound, to the count
    with pytest.raises(APIError) as refused:
        asyncio.run(renderer.encode(text))
    assert "maximum context length is 2048 tokens" in refused.value.message
    assert sum(seen) < len(text) // 4, "the count stopped soon after the context was full"
    assert max(seen) <= 4096


def test_a_long_text_that_fits_passes_the_piecewise_count_whole(renderer, monkeypatch):
    monkeypatch.setattr(prompts_module, "PIECE_CHARS", 512)
    text = "The quick brown fox jumps over the lazy dog.  Twice,   with spaces. " * 40
    tokenizer = renderer._lanes[0].tokenizer
    whole = len(tokenizer.encode(text, add_special_tokens=False))
    assert whole < 2048
    ids = asyncio.run(renderer.encode(text, add_special_tokens=False))  # counted in pieces, then encoded whole
    assert len(ids) == whole


def test_short_and_long_texts_take_separate_lanes(renderer):
    lanes = []

    def which(tokenizer, *_):
        lanes.append(next(i for i, lane in enumerate(renderer._lanes) if lane.tokenizer is tokenizer))

    asyncio.run(renderer._run(10, which))
    asyncio.run(renderer._run(prompts_module.LONG_TEXT_CHARS, which))
    assert lanes == [0, 1]
    assert renderer._lanes[0].tokenizer is not renderer._lanes[1].tokenizer
