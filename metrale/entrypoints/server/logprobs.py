"""The engine's per-token logprobs in OpenAI's two shapes (chat and legacy completions).

An engine entry is {token_id: Logprob(logprob, rank, decoded_token)}: the sampled token first,
then the top-k alternatives. A token that is part of a UTF-8 character decodes alone as U+FFFD;
its `bytes` are those of that text, as vLLM reports them.
"""

from __future__ import annotations

import math

from metrale.messages.outputs import Logprob


def _finite(value: float) -> float:
    # JSON has no -inf: a token the model rules out entirely reports the most negative float.
    return value if math.isfinite(value) else -9999.0


def _token_text(token_id: int, entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"token_id:{token_id}"


def _sampled(entry: dict[int, Logprob]) -> tuple[int, Logprob]:
    return next(iter(entry.items()))


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda pair: pair[1].rank)[:k]


def chat_logprobs(entries: list[dict[int, Logprob]], top_k: int) -> dict:
    content = []
    for entry in entries:
        token_id, sampled = _sampled(entry)
        text = _token_text(token_id, sampled)
        top = []
        for tid, lp in _top(entry, top_k):
            t = _token_text(tid, lp)
            top.append({"token": t, "logprob": _finite(lp.logprob), "bytes": list(t.encode("utf-8", "replace"))})
        content.append({"token": text, "logprob": _finite(sampled.logprob),
                        "bytes": list(text.encode("utf-8", "replace")), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[dict[int, Logprob]], top_k: int, text_offset: int) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        token_id, sampled = _sampled(entry)
        text = _token_text(token_id, sampled)
        tokens.append(text)
        token_logprobs.append(_finite(sampled.logprob))
        top = {_token_text(tid, lp): _finite(lp.logprob) for tid, lp in _top(entry, top_k)}
        top.setdefault(text, _finite(sampled.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
