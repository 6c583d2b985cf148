"""The reference DSA indexer backend: plain PyTorch over the paged indexer cache, CPU or CUDA.

One sequence at a time: gather its keys (cached prefix and new tokens, in position order,
dequantized when the cache is fp8), score every query row against every position, mask the
positions after the row's own, keep the top index_topk. Slow and obviously right; the Triton
indexer is tested against it. `index_scores` and `top_positions` are exported for those tests.
"""

from __future__ import annotations

import torch

from metrale.layers.attention.torch_backend import gather_context
from metrale.layers.cache_backend import register_backend
from metrale.layers.mla.indexer_backend import IndexerBackend, IndexerCache, IndexerMetadata
from metrale.layers.mla.indexer_fp8 import dequantize_keys, quantize_keys
from metrale.layers.mla.torch_backend import causal_mask


def write_keys_reference(keys: torch.Tensor, cache: IndexerCache, slot_mapping: torch.Tensor) -> None:
    block_size = cache.keys.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    if cache.is_fp8:
        quantized, scales = quantize_keys(keys[keep])
        cache.keys[blocks, offsets] = quantized
        cache.scales[blocks, offsets] = scales
    else:
        cache.keys[blocks, offsets] = keys[keep].to(cache.keys.dtype)


def gather_keys(cache: IndexerCache, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's keys [seq_len, D] in float32, in position order."""
    keys = gather_context(cache.keys, block_table, seq_len)
    if cache.is_fp8:
        return dequantize_keys(keys, gather_context(cache.scales, block_table, seq_len))
    return keys.float()


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [Q, H, D], weights [Q, H], keys [S, D] -> float32 [Q, S]: sum_h w * relu(q_h . k)."""
    per_head = torch.relu(torch.einsum("qhd,sd->qhs", q.float(), keys.float()))
    return torch.einsum("qh,qhs->qs", weights.float(), per_head)


def top_positions(scores: torch.Tensor, allowed: torch.Tensor, index_topk: int) -> torch.Tensor:
    """scores [Q, S], allowed [Q, S] bool -> int32 [Q, index_topk]: each row's allowed positions of
    largest score (min(index_topk, allowed count) of them), -1 after."""
    masked = scores.masked_fill(~allowed, float("-inf"))
    k = min(index_topk, scores.shape[1])
    values, positions = masked.topk(k, dim=-1)
    positions = positions.masked_fill(values == float("-inf"), -1).to(torch.int32)
    if k < index_topk:
        positions = torch.cat((positions, positions.new_full((scores.shape[0], index_topk - k), -1)), dim=-1)
    return positions


@register_backend
class TorchIndexerBackend(IndexerBackend):
    name = "torch"

    def write_keys(self, keys, cache: IndexerCache, slot_mapping) -> None:
        write_keys_reference(keys, cache, slot_mapping)

    def select(self, q, weights, cache: IndexerCache, metadata: IndexerMetadata, index_topk: int) -> torch.Tensor:
        # Rows outside every sequence (a padded batch) keep -1: no sequence reads them.
        out = torch.full((q.shape[0], index_topk), -1, dtype=torch.int32, device=q.device)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            if query_len == 0:
                continue
            rows = slice(start, start + query_len)
            keys = gather_keys(cache, metadata.block_tables[i], seq_len)
            scores = index_scores(q[rows], weights[rows], keys)
            out[rows] = top_positions(scores, causal_mask(query_len, seq_len, q.device), index_topk)
            start += query_len
        return out
