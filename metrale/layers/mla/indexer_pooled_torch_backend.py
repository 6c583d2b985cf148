"""The DSA indexer backend of pooled index groups (cache kind "pooled_indexer", GLM-5.3), plain
PyTorch, CPU or CUDA; the only one so far (no Triton kernel: not graph-capturable, it reads the
step's host lists).

Cache: per token of every layer that runs its own indexer, two planes under the MLA block table:
the key [index_head_dim] and the group gate logits [index_head_dim] (index_kpool_compress_gate
@ x, before the position's bias), both in the indexer cache dtype (the model dtype or bfloat16;
fp8 is refused by the layer). A group's key is rebuilt from its positions' entries at every
selection, so prefix hits, chunked prefill and preemption need nothing beyond what every paged
cache has: each entry depends on its own token only.

Selection, one sequence at a time: gather its keys and gates in position order, build its
complete groups' keys, score every query row against them, pick (layers/mla/indexer_pooling.py).
"""

from __future__ import annotations

import torch

from metrale.layers.attention.torch_backend import gather_context
from metrale.layers.cache_backend import CacheBackend, register_backend
from metrale.layers.forward_context import BatchLayout
from metrale.layers.mla.indexer_backend import IndexerCache, IndexerMetadata
from metrale.layers.mla.indexer_pooling import IndexerPooling, group_keys, pooled_selection
from metrale.layers.mla.indexer_torch_backend import index_scores, write_keys_reference

KIND = "pooled_indexer"


@register_backend
class TorchPooledIndexerBackend(CacheBackend):
    kind = KIND
    name = "torch"

    def build_metadata(self, layout: BatchLayout) -> IndexerMetadata:
        return IndexerMetadata.of(layout)

    def write_keys(self, keys: torch.Tensor, gates: torch.Tensor, cache: IndexerCache,
                   slot_mapping: torch.Tensor) -> None:
        """keys, gates [T, index_head_dim] into the cache at their slots (-1: not written)."""
        write_keys_reference(keys, cache, slot_mapping)
        write_keys_reference(gates, IndexerCache(cache.pool_gates), slot_mapping)

    def select(self, q: torch.Tensor, weights: torch.Tensor, cache: IndexerCache, metadata: IndexerMetadata,
               index_topk: int, pooling: IndexerPooling, bias: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], weights [T, H] float32 (scales folded in), bias [P, D] -> int32
        [T, pooling.width(index_topk)], -1 padded."""
        out = torch.full((q.shape[0], pooling.width(index_topk)), -1, dtype=torch.int32, device=q.device)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            if query_len == 0:
                continue
            rows = slice(start, start + query_len)
            keys = gather_context(cache.keys, metadata.block_tables[i], seq_len)
            gates = gather_context(cache.pool_gates, metadata.block_tables[i], seq_len)
            scores = index_scores(q[rows], weights[rows], group_keys(keys, gates, bias))
            positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
            out[rows] = pooled_selection(scores, positions, pooling, index_topk)
            start += query_len
        return out
