"""The n-gram drafter (prompt lookup): draft tokens copied from earlier in the sequence.

The last n tokens of a request (prompt and output), n from `prompt_lookup_max` down to
`prompt_lookup_min`, are looked up among its earlier tokens; at the most recent earlier
occurrence, the tokens that followed it (up to k) are the draft. Text that quotes or repeats
itself (code edits, extraction, summaries, loops) drafts well; other text proposes nothing, and
the request then runs a plain decode step.

It lives on the scheduler's side, not in the runner: it needs only the token ids the scheduler
already holds, no tensors, and the drafts must be known when the step is planned, because they
take room in the token budget and KV slots. A draft has no distribution: the verifier treats it
as deterministic (executor/rejection_sampler.py). No torch here.
"""

from __future__ import annotations


class NgramDrafter:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max or num_speculative_tokens < 1:
            raise ValueError(f"n-gram drafter: need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({prompt_lookup_max}) and k ({num_speculative_tokens}) >= 1")
        self.k = num_speculative_tokens
        self.lookup_min = prompt_lookup_min
        self.lookup_max = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) draft tokens to follow `token_ids`, or [] without a match."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        if limit <= 0:
            return []
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            pattern = token_ids[length - n:]
            first = pattern[0]
            # The latest start whose n-gram ends before the last token, so a token follows it.
            for start in range(length - n - 1, -1, -1):
                if token_ids[start] == first and token_ids[start:start + n] == pattern:
                    return token_ids[start + n:start + n + limit]
        return []
