"""Prompt lookup on the device: each request's n-gram draft from its token history.

The rule is the host drafter's (engine/ngram_drafter.py), for requests whose history lives in a
device buffer (executor/drafters/ngram.py): the last n tokens of the request's L known tokens,
n from max_n down to min_n, are looked up among its earlier tokens; at the latest earlier
occurrence (one with a token after it), the tokens that followed it, up to k, are the draft.

In terms of where a candidate occurrence ends (e, at most L - 2): its match length is the number
of tokens that agree going backwards from e and from L - 1. The host's answer is the candidate
with the longest match, capped at max_n and at least min_n, the latest e among equals; the
draft is history[e + 1 : min(e + 1 + k, L)]. One program per request scans its history in
blocks of candidate ends, keeping the best (length, e) as one integer.

`ngram_drafts` dispatches: the Triton kernel, or the PyTorch reference (the same formulation,
request by request; tests check both against the host drafter).
"""

from __future__ import annotations

import torch

from metrale.kernels import tl, triton, use_triton

_END_BITS = 40  # a score is match_length << _END_BITS | end


@triton.jit
def _ngram_kernel(history_ptr, stride_h, rows_ptr, lengths_ptr, out_ptr, MIN_N: tl.constexpr,
                  MAX_N: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
                  END_BITS: tl.constexpr):
    pid = tl.program_id(0)
    base = history_ptr + tl.load(rows_ptr + pid).to(tl.int64) * stride_h
    length = tl.load(lengths_ptr + pid).to(tl.int64)
    best = tl.full((), -1, tl.int64)
    for start in range(0, length - 1, BLOCK):
        ends = start + tl.arange(0, BLOCK).to(tl.int64)
        running = ends <= length - 2  # a token follows the occurrence
        matched = tl.zeros((BLOCK,), tl.int64)
        for i in tl.static_range(MAX_N):
            # ends - i >= 0 below implies length - 1 - i > 0: the clamp only keeps the address valid
            pattern = tl.load(base + tl.maximum(length - 1 - i, 0))
            candidate = tl.load(base + ends - i, mask=running & (ends - i >= 0), other=-2)
            running = running & (ends - i >= 0) & (candidate == pattern)
            matched += running.to(tl.int64)
        score = tl.where(matched >= MIN_N, (matched << END_BITS) | ends, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    # No match: the draft would start past the history (every position masked).
    end = tl.where(best >= 0, best & ((1 << END_BITS) - 1), length)
    offsets = tl.arange(0, K_PAD)
    positions = end + 1 + offsets
    keep = (positions < length) & (offsets < K)
    drafts = tl.load(base + positions, mask=keep, other=-1)
    tl.store(out_ptr + pid * K + offsets, drafts.to(tl.int64), mask=offsets < K)


def ngram_drafts_triton(history: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                        max_n: int, block: int = 1024) -> torch.Tensor:
    """int64 [len(rows), k]: row i's draft from history[rows[i], :lengths[i]] (int32 or int64
    tokens), -1 past a short draft and where nothing matches."""
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=history.device)
    if rows.shape[0]:
        _ngram_kernel[(rows.shape[0],)](history, history.stride(0), rows, lengths, out, MIN_N=min_n, MAX_N=max_n,
                                        K=k, K_PAD=triton.next_power_of_2(k), BLOCK=block, END_BITS=_END_BITS)
    return out


def ngram_drafts_reference(history: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                           max_n: int) -> torch.Tensor:
    """The kernel's rule in PyTorch, one request at a time (its length read on the host)."""
    out = torch.full((rows.shape[0], k), -1, dtype=torch.int64, device=history.device)
    for i, (row, length) in enumerate(zip(rows.tolist(), lengths.tolist())):
        tokens = history[row, :length].long()
        ends = torch.arange(max(length - 1, 0), device=history.device)  # each can have a token after it
        running = torch.ones_like(ends, dtype=torch.bool)
        matched = torch.zeros_like(ends)
        for back in range(min(max_n, length)):
            running &= (ends >= back) & (tokens[(ends - back).clamp(min=0)] == tokens[length - 1 - back])
            matched += running
        score = torch.where(matched >= min_n, (matched << _END_BITS) | ends, -1)
        if score.numel() and int(score.max()) >= 0:
            end = int(score.max()) & ((1 << _END_BITS) - 1)
            draft = tokens[end + 1:min(end + 1 + k, length)]
            out[i, :draft.numel()] = draft
    return out


def ngram_drafts(history: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                 max_n: int) -> torch.Tensor:
    if use_triton(history):
        return ngram_drafts_triton(history, rows, lengths, k, min_n, max_n)
    return ngram_drafts_reference(history, rows, lengths, k, min_n, max_n)
