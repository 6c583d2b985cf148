"""The DSA indexer backend interface (cache kind "indexer"): stores each new token's indexer key
in the paged cache and, for every query row of the step, selects the context positions its MLA
attention will see (DeepSeek Sparse Attention; the layer is layers/mla/indexer.py).

The cache lives under the same block table as the MLA latent of its layer (position p of
sequence i at block `block_tables[i][p // block_size]`, offset `p % block_size`):

- bfloat16 (or the model dtype): one plane of [index_head_dim] keys;
- fp8: one plane of [index_head_dim] float8_e4m3fn keys, then one plane of [1] float32 scales,
  one per token (amax(|k|) / 448; keys stored as round-to-nearest-even e4m3 of k / scale; a zero
  key gets scale 1): layers/mla/indexer_fp8.py.

Scores and selection, for query row t at position p_t of its sequence and every context position
s <= p_t:

    score[t, s] = sum_h w[t, h] * relu(q[t, h, :] . k[s, :])        (float32)

with q [T, H, D] the roped indexer queries, k the (dequantized) cached keys and w [T, H] float32
the head weights with both scales folded in (index_n_heads ** -0.5 * index_head_dim ** -0.5).
Row t keeps the min(index_topk, p_t + 1) positions of largest score, as int32 positions of its
own sequence in any order, padded with -1 to index_topk columns: what MLABackend.forward takes
as `topk_indices`. Where two scores are within float rounding of each other, backends may pick
differently.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

import torch

from metrale.layers.cache_backend import CacheBackend
from metrale.layers.forward_context import AttentionMetadata, BatchLayout


@dataclass(frozen=True)
class IndexerCache:
    """One layer's indexer cache, as bound: keys [num_blocks, block_size, index_head_dim] in the
    cache dtype, and with fp8 keys their scales [num_blocks, block_size] float32 (else None);
    with pooled index groups (GLM-5.3, layers/mla/indexer_pooling.py) the group gate logits
    [num_blocks, block_size, index_head_dim] in the keys' dtype (else None)."""

    keys: torch.Tensor
    scales: torch.Tensor | None = None
    pool_gates: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.scales is not None


@dataclass
class IndexerMetadata(AttentionMetadata):
    """The paged layout of the step (as attention's), plus the selections the step's "full"
    layers made, by model layer number: a "shared" layer (GLM-5) reads the one of the full
    layer before it. Built fresh for every step, so a selection never outlives its step."""

    selections: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, layout: BatchLayout) -> "IndexerMetadata":
        base = AttentionMetadata.of(layout)
        return cls(**{f: getattr(base, f) for f in AttentionMetadata.__dataclass_fields__})


class IndexerBackend(CacheBackend):
    kind = "indexer"

    def build_metadata(self, layout: BatchLayout) -> IndexerMetadata:
        return IndexerMetadata.of(layout)

    @abstractmethod
    def write_keys(self, keys: torch.Tensor, cache: IndexerCache, slot_mapping: torch.Tensor) -> None:
        """keys [T, index_head_dim] (normalised, roped) into the cache at their slots (-1:
        padding, not written); fp8 caches quantize them per token on the way in."""

    @abstractmethod
    def select(self, q: torch.Tensor, weights: torch.Tensor, cache: IndexerCache, metadata: IndexerMetadata,
               index_topk: int) -> torch.Tensor:
        """q [T, H, D] (roped), weights [T, H] float32 (scales folded in) -> int32 [T, index_topk]:
        each row's selected positions, -1 padded (module docstring)."""
