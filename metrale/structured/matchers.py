"""GrammarMatchers: one xgrammar matcher per constrained request of a model runner.

A matcher follows its request's output tokens lazily: when a step samples the request, the
matcher first accepts the outputs it has not seen (every one of them is known by then: the
engine reads a step's tokens before it launches a step that samples a constrained request),
then fills the request's row of the step's token bitmask. So a request resumed after
preemption gets a fresh matcher that catches up on its outputs so far, an aborted or finished
one is dropped with the runner's state, and each of the n completions of a request, being its
own engine request, has its own matcher.

A verify step (speculative decoding) gives a drafted request 1 + k logits rows: row j is masked by
the grammar's state after the request's outputs and its first j drafts. The matcher accepts the
drafts to fill those rows and rolls them back at once (xgrammar's `rollback`), so it only ever
holds outputs; the accepted drafts reach it as outputs next time. A draft the grammar refuses is
refused by the row before it too (its bit is clear there), so no draft past it can be accepted:
the rows after it repeat that row's mask.

The matcher's stop tokens are the request's end-of-sequence ids: the bitmask allows them only
where the grammar's output is complete, and once complete nothing else, so a constrained
request ends with finish_reason "stop" unless max_tokens comes first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import PLACEHOLDER
from metrale.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)

# From this many constrained rows on, xgrammar fills the bitmask rows on several threads.
BATCH_FILL_MIN_ROWS = 8


@dataclass
class _Matcher:
    matcher: object  # xgrammar.GrammarMatcher
    stop_token_ids: list[int]
    num_accepted: int = 0  # output tokens accepted so far
    warned: bool = False


@dataclass
class TokenBitmask:
    """A step's constrained rows (indices into the sampled rows) and their packed bitmask,
    int32 [len(rows), ceil(vocab / 32)] on the host (pinned for a CUDA runner)."""

    rows: list[int]
    bitmask: torch.Tensor

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor(self.rows, dtype=torch.int64, pin_memory=self.bitmask.is_pinned())
        return rows.to(device, non_blocking=True), self.bitmask.to(device, non_blocking=True)


class GrammarMatchers:
    def __init__(self, grammars: GrammarCache, pin_memory: bool = False):
        self.grammars = grammars
        self.pin_memory = pin_memory
        self._matchers: dict[str, _Matcher] = {}
        self._batch = None  # xgrammar.BatchGrammarMatcher, made for the first large batch

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, params: SamplingParams) -> None:
        """A matcher at the grammar's start. Rank 0 finds the grammar compiled (the request was
        refused otherwise); a worker rank compiles it here, waiting as long as it takes: the
        spec compiled within the timeout on rank 0, and a rank cannot refuse what rank 0 took."""
        import xgrammar as xgr

        self.grammars.ready().result()
        compiled = self.grammars.submit(params.structured_outputs).result()
        stops = sorted(set(params.eos_token_ids))
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self._matchers[request_id] = _Matcher(matcher, stops or list(matcher.stop_token_ids))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def bitmask(self, rows: list[tuple[str, list[int], int]],
                drafts: list[list[int]] | None = None) -> TokenBitmask | None:
        """The token bitmask of a step's sampled rows (request id, its tokens, its prompt length),
        for those that have a matcher; None when none has. `drafts` (a verify step): each row's
        drafts, known on the host; a row with k of them spans 1 + k logits rows, in row order,
        and TokenBitmask.rows are then indices into those logits rows."""
        drafts = drafts if drafts is not None else [[] for _ in rows]
        starts = np.concatenate([[0], np.cumsum([1 + len(d) for d in drafts])[:-1]]).astype(int).tolist()
        constrained = [(rid, starts[i], self._matchers[rid], tokens, num_prompt, drafts[i])
                       for i, (rid, tokens, num_prompt) in enumerate(rows) if rid in self._matchers]
        if not constrained:
            return None
        import xgrammar as xgr

        words = -(-self.grammars.vocab_size // 32)
        num_rows = sum(1 + len(d) for *_, d in constrained)
        bitmask = torch.zeros((num_rows, words), dtype=torch.int32, pin_memory=self.pin_memory)
        logit_rows, stops = [], []
        live, live_rows = [], []
        for rid, i, entry, tokens, num_prompt, request_drafts in constrained:
            j = len(logit_rows)
            logit_rows += range(i, i + 1 + len(request_drafts))
            stops += [entry.stop_token_ids] * (1 + len(request_drafts))
            self._catch_up(rid, entry, tokens, num_prompt)
            if request_drafts:
                self._fill_over_drafts(entry, request_drafts, bitmask, j)
            elif entry.matcher.is_terminated():  # after a stop token: only stop tokens again
                _allow(bitmask[j], entry.stop_token_ids)
            else:
                live.append(entry.matcher)
                live_rows.append(j)
        if len(live) >= BATCH_FILL_MIN_ROWS:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)
        else:
            for matcher, j in zip(live, live_rows):
                matcher.fill_next_token_bitmask(bitmask, j)
        # A grammar that reached a dead end (allows no token at all) may still stop.
        for j in np.flatnonzero(~bitmask.numpy().any(axis=1)).tolist():
            _allow(bitmask[j], stops[j])
        return TokenBitmask(logit_rows, bitmask)

    @staticmethod
    def _fill_over_drafts(entry: _Matcher, drafts: list[int], bitmask: torch.Tensor, first: int) -> None:
        """Rows first .. first + len(drafts) of `bitmask`: the grammar's state after each prefix of
        the drafts; the matcher is rolled back to where it started."""
        matcher, depth = entry.matcher, 0
        for j, draft in enumerate([*drafts, None]):
            row = first + j
            if matcher.is_terminated():
                _allow(bitmask[row], entry.stop_token_ids)
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
            if draft is None:
                break
            if draft == PLACEHOLDER:
                raise RuntimeError("a constrained request's drafts must be known on the host")
            if matcher.is_terminated() or not matcher.accept_token(draft):
                # The grammar refuses this draft, so row `row` refuses it: nothing after it is read.
                bitmask[row + 1:first + len(drafts) + 1] = bitmask[row]
                break
            depth += 1
        if depth:
            matcher.rollback(depth)

    def _catch_up(self, request_id: str, entry: _Matcher, tokens: list[int], num_prompt: int) -> None:
        matcher = entry.matcher
        known = len(tokens) - num_prompt
        while entry.num_accepted < known:
            token = tokens[num_prompt + entry.num_accepted]
            if token == PLACEHOLDER:
                raise RuntimeError(f"request {request_id}: a constrained request is sampled before its previous "
                                   f"token is known (the engine must read that step first)")
            if matcher.is_terminated() or not matcher.accept_token(token):
                if not entry.warned:
                    entry.warned = True
                    logger.warning("request %s: token %d is not one its grammar allows here; the output may not "
                                   "follow the grammar", request_id, token)
            entry.num_accepted += 1


def _allow(row: torch.Tensor, token_ids: list[int]) -> None:
    for token in token_ids:
        word, bit = divmod(token, 32)
        if word < row.shape[0]:
            row[word] |= _bit(bit)


def _bit(bit: int) -> int:
    """Bit `bit` of an int32 word, as the signed value torch stores."""
    value = 1 << bit
    return value - (1 << 32) if value >= 1 << 31 else value
