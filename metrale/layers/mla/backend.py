"""The MLA backend interface (cache kind "mla"): stores each new token's latent in the paged
cache and computes attention of the flattened query rows over the latents of their contexts
(layout in layers/forward_context.py, the same block tables as every paged cache).

The cache holds one plane of [kv_lora_rank + qk_rope_head_dim] per token: the normalised latent
c_kv, then the roped shared key k_pe. Keys and values are never stored: for head h,

    k_h = [W_UK[h] c_kv | k_pe]      (qk_nope + qk_rope wide; 192 on DeepSeek-V3)
    v_h =  W_UV[h] c_kv              (v_head_dim wide; 128 on DeepSeek-V3)

where kv_b_proj stacks [W_UK[h]; W_UV[h]] for every head. A backend computes the same attention
in one of two forms, chosen per sequence:

- up-projected (prefill and extend: many query rows): kv_b_proj over the context's latents
  gives k_nope and v; attention of q = [q_nope | q_pe] over k, causal with the prefix;
- absorbed (decode: one query row): W_UK folded into the query (q_nope W_UK, a query over the
  latent), MQA over the cache entries [c_kv | k_pe] with the latent as the value, then W_UV on
  the attended latent. Nothing per context token is up-projected.

Sparse attention (DSA, layers/mla/indexer_backend.py): `topk_indices` int32 [T, K] restricts
query row t to the positions listed in row t (positions within its own sequence, the block
table's numbering; each at most once, any order, -1 padding ignored; every listed position is
at most the row's own, and a row lists at least its own position). None: dense causal attention.
Both forms honour it.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from metrale.layers.cache_backend import CacheBackend
from metrale.layers.forward_context import AttentionMetadata, BatchLayout


@dataclass(frozen=True)
class LatentUpProjection:
    """One MLA layer's kv_b_proj, in both forms the backends use (this rank's heads)."""

    kv_b_proj: Callable[[torch.Tensor], torch.Tensor]  # latents [S, rank] -> [S, heads * (qk_nope + v)]
    w_uk: torch.Tensor  # [heads, qk_nope, rank]: k_nope[h] = w_uk[h] @ c_kv
    w_uv: torch.Tensor  # [heads, v, rank]:       v[h]      = w_uv[h] @ c_kv

    @property
    def qk_nope_head_dim(self) -> int:
        return self.w_uk.shape[1]

    @property
    def v_head_dim(self) -> int:
        return self.w_uv.shape[1]


class MLABackend(CacheBackend):
    kind = "mla"
    # Whether it runs MLA without RoPE (qk_rope_head_dim 0, GLM-5.3): cache entries of the latent
    # alone. The Triton kernels assume a rope part; the reference does not.
    supports_nope = False

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        return AttentionMetadata.of(layout)

    @abstractmethod
    def write_latent(self, kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                     slot_mapping: torch.Tensor, latent_scale: float = 1.0) -> None:
        """kv_c [T, rank] (normalised), k_pe [T, rope] (roped) into cache [num_blocks, block_size,
        rank + rope] at their slots (-1: padding, not written). An fp8 cache stores
        value / latent_scale, saturated at +-448."""

    @abstractmethod
    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, up: LatentUpProjection,
                metadata: AttentionMetadata, scale: float, topk_indices: torch.Tensor | None = None,
                latent_scale: float = 1.0) -> torch.Tensor:
        """q_nope [T, heads, qk_nope], q_pe [T, heads, rope] (roped) -> [T, heads, v_head_dim];
        `topk_indices` [T, K] int32: the positions each row attends to (module docstring). An fp8
        cache is read back as stored value x latent_scale."""
