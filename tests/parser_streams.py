"""Feeding an output parser the way the server does: in chunks, as the engine produces text."""

from __future__ import annotations

import random


def random_chunks(text: str, seed: int, longest: int = 9) -> list[str]:
    """`text` cut at random places into pieces of 1..longest characters."""
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, longest)
        chunks.append(text[i:i + n])
        i += n
    return chunks


def merged(events: list) -> list:
    """Adjacent text events of the same kind joined, so splits that differ only in where text was cut
    compare equal."""
    out = []
    for event in events:
        if out and type(event) is type(out[-1]) and isinstance(event, str):
            out[-1] = out[-1] + event
        elif out and type(event) is type(out[-1]) and hasattr(event, "text") and not hasattr(event, "name"):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def streamed(parser, chunks: list[str]) -> list:
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def check_streams(make_parser, text: str, seeds: int = 25) -> list:
    """The whole-text events; every random split (and one character at a time) gives the same."""
    whole = merged(make_parser().parse(text))
    splits = [random_chunks(text, seed) for seed in range(seeds)] + [list(text)]
    for chunks in splits:
        assert merged(streamed(make_parser(), chunks)) == whole, chunks
    return whole
