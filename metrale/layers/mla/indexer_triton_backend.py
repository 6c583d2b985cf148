"""The Triton DSA indexer backend (cache kind "indexer"): the key write, scores and top-k of
kernels/dsa_indexer.py over the paged indexer cache, tested against the PyTorch reference
(tests/layers/test_indexer_triton_backend.py; the kernels themselves in
tests/kernels/test_dsa_indexer_kernels.py and tests/gpu/test_gpu_indexer.py).

Nothing is read on the host: each row's sequence and position come from the step's
query_start_loc and seq_lens on the device, and the scores are as wide as the block table
(block_tables.shape[1] * block_size), so a pure decode step replays in CUDA graphs. Rows past the
step's last sequence (a padded batch) select nothing (-1), as in the reference.
"""

from __future__ import annotations

import torch

from metrale.kernels import HAS_TRITON
from metrale.kernels.dsa_indexer import indexer_topk_triton, write_indexer_keys_triton
from metrale.layers.cache_backend import register_backend
from metrale.layers.mla.indexer_backend import IndexerBackend, IndexerCache, IndexerMetadata

if not HAS_TRITON:
    raise ImportError("triton is not installed")


@register_backend
class TritonIndexerBackend(IndexerBackend):
    name = "triton"
    supports_cuda_graphs = True

    def write_keys(self, keys: torch.Tensor, cache: IndexerCache, slot_mapping: torch.Tensor) -> None:
        write_indexer_keys_triton(keys.contiguous(), cache.keys, cache.scales, slot_mapping)

    def select(self, q: torch.Tensor, weights: torch.Tensor, cache: IndexerCache, metadata: IndexerMetadata,
               index_topk: int) -> torch.Tensor:
        return indexer_topk_triton(q.contiguous(), weights.float().contiguous(), cache.keys, cache.scales,
                                   metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, index_topk)
