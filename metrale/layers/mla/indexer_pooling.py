"""Pooled index groups (GLM-5.3's `index_kpool`): the DSA indexer scores groups of P consecutive
positions instead of single positions, and a selected group brings all P of its positions into
the attention. As transformers' Glm5NextTextIndexer (pure functions; the backend is
layers/mla/indexer_pooled_torch_backend.py):

    groups      positions [g P, (g + 1) P) of a sequence, g = 0, 1, ...; only complete ones
    group key   sum_j softmax_j(gate[g P + j] + bias[j]) * key[g P + j]
                (per channel: gate = index_kpool_compress_gate @ x, [index_head_dim] per token;
                bias = index_kpool_compress_ape [P, index_head_dim])
    score       sum_h w[h] * relu(q[h] . group key)        as the plain indexer, per group
    row at p    may pick group g only when the group ends at or before p ((g + 1) P - 1 <= p);
                keeps its index_topk / P best such groups, expanded to their positions
    tail        with `select_tail` (index_kpool_always_select_tail), the row's own incomplete
                group, positions [P floor((p + 1) / P), p], is always added (up to P - 1 of them)

A row's selection is index_topk + P - 1 columns wide with the tail (index_topk without), -1
padded, in no particular order (attention treats it as a set; groups and tail never overlap).
With P = 1 this is the plain indexer's selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IndexerPooling:
    pool_size: int  # index_kpool, P
    select_tail: bool  # index_kpool_always_select_tail

    def width(self, index_topk: int) -> int:
        """Columns of a row's selection."""
        return index_topk + (self.pool_size - 1 if self.select_tail else 0)

    def check(self, index_topk: int) -> None:
        if self.pool_size < 1 or index_topk % self.pool_size:
            raise ValueError(f"index_topk ({index_topk}) must be a multiple of index_kpool ({self.pool_size})")


def group_keys(keys: torch.Tensor, gates: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One sequence's keys and gate logits [S, D] (position order), bias [P, D] -> the keys of its
    complete groups [S // P, D], float32."""
    pool = bias.shape[0]
    groups = keys.shape[0] // pool
    dim = keys.shape[1]
    k = keys[:groups * pool].float().view(groups, pool, dim)
    logits = gates[:groups * pool].float().view(groups, pool, dim) + bias.float()
    return (logits.softmax(dim=1) * k).sum(dim=1)


def pooled_selection(scores: torch.Tensor, positions: torch.Tensor, pooling: IndexerPooling,
                     index_topk: int) -> torch.Tensor:
    """scores [Q, G] (each row against every complete group of its sequence), positions [Q] (each
    row's own, int64) -> int32 [Q, pooling.width(index_topk)] (module docstring)."""
    pool = pooling.pool_size
    rows, groups = scores.shape
    device = scores.device
    group_end = torch.arange(groups, device=device) * pool + pool - 1
    allowed = group_end[None, :] <= positions[:, None]
    keep = min(index_topk // pool, groups)
    masked = scores.masked_fill(~allowed, float("-inf"))
    values, chosen = masked.topk(keep, dim=-1)
    offsets = torch.arange(pool, device=device)
    picked = (chosen[..., None] * pool + offsets).masked_fill((values == float("-inf"))[..., None], -1)
    parts = [picked.reshape(rows, keep * pool)]
    if pooling.select_tail and pool > 1:
        tail_start = (positions + 1) // pool * pool
        tail = tail_start[:, None] + offsets[:pool - 1]
        parts.append(tail.masked_fill(tail > positions[:, None], -1))
    selection = torch.cat(parts, dim=-1).to(torch.int32)
    width = pooling.width(index_topk)
    if selection.shape[1] < width:
        selection = torch.cat((selection, selection.new_full((rows, width - selection.shape[1]), -1)), dim=-1)
    return selection
