"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5): per layer and step, it picks the context
positions each query row's MLA attention sees. As transformers' DeepseekV32Indexer:

    q       = wq_b(q_resid)                  q_resid = q_a_layernorm(q_a_proj(x)), the MLA's own
              heads of [index_head_dim], index_n_heads of them
    k       = k_norm(wk(x))                  one key of [index_head_dim] per token, a LayerNorm
    RoPE on the first qk_rope_head_dim dims of q and k (the MLA's frequencies): half-split on
              DeepSeek-V3.2, interleaved on GLM-5 (de-interleaved first, as the MLA's rope)
    cache  <- k per token (kind "indexer", under the MLA block table; fp8: keys and scales)
    w       = weights_proj(x) in float32 * index_n_heads ** -0.5 * index_head_dim ** -0.5
    select  = per row, the min(index_topk, p + 1) positions of largest
              sum_h w[h] * relu(q[h] . k[s]) among s <= p (layers/mla/indexer_backend.py)

The scales fold into w: relu(a) * c = relu(a * c) for c > 0, so that is transformers' scoring.
weights_proj stays in float32 whatever the model dtype (transformers keeps it there) and is never
quantized: it is a Float32Router, the float32 replicated projection DeepSeek's MoE router uses.

Every projection and the norm are replicated on the TP ranks: each rank computes the same keys
and the same selection, so nothing is communicated and the cache is the same on every rank.

Pooled index groups (GLM-5.3, `pooling`): the indexer scores groups of index_kpool positions
(layers/mla/indexer_pooling.py). It then has two more parameters (index_kpool_compress_gate
[index_head_dim, hidden], index_kpool_compress_ape [index_kpool, index_head_dim]), caches each
token's gate logits beside its key (a second plane), and is of cache kind "pooled_indexer" (backend:
layers/mla/indexer_pooled_torch_backend.py); its selections are index_topk + index_kpool - 1
wide with the tail. fp8 keys are not implemented there and refused by name. GLM-5.3's indexer
has no RoPE (rope_dim 0).

Not a CachedLayer itself: its MLA layer declares the indexer specs after its latent spec and
hands it the tensors (`key_cache_specs`, `bind`), so the layer's caches stay one entry in the
layout, in the order the contract fixes (latent, keys[, scales]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metrale.config.cache_config import FP8, CacheConfig
from metrale.config.errors import OptionError
from metrale.layers.cache_spec import PagedCacheSpec
from metrale.layers.forward_context import get_forward_context
from metrale.layers.linear import ReplicatedLinear
from metrale.layers.mla.indexer_backend import IndexerCache
from metrale.layers.mla.indexer_pooled_torch_backend import KIND as POOLED_KIND
from metrale.layers.mla.indexer_pooling import IndexerPooling
from metrale.layers.moe.router import Float32Router
from metrale.layers.rotary import deinterleave

KIND = "indexer"
KEY_NORM_EPS = 1e-6  # k_norm's, as transformers builds it


@dataclass(frozen=True)
class IndexerDims:
    hidden_size: int
    q_lora_rank: int
    num_heads: int  # index_n_heads, every one on every rank
    head_dim: int  # index_head_dim
    rope_dim: int  # qk_rope_head_dim: the leading dims of each head that RoPE rotates (0: none)
    index_topk: int


class DSAIndexer(nn.Module):
    def __init__(self, dims: IndexerDims, rope_interleaved: bool, pooling: IndexerPooling | None = None):
        """`pooling`: GLM-5.3's pooled index groups (module docstring), else one position each."""
        super().__init__()
        if not 0 <= dims.rope_dim <= dims.head_dim:
            raise ValueError(f"the indexer's rope dims ({dims.rope_dim}) must fit its head_dim ({dims.head_dim})")
        self.dims, self.rope_interleaved, self.pooling = dims, rope_interleaved, pooling
        self.kind = KIND if pooling is None else POOLED_KIND
        if pooling is not None:
            pooling.check(dims.index_topk)
            self.index_kpool_compress_gate = nn.Parameter(torch.empty(dims.head_dim, dims.hidden_size),
                                                          requires_grad=False)
            self.index_kpool_compress_ape = nn.Parameter(torch.empty(pooling.pool_size, dims.head_dim),
                                                         requires_grad=False)
        self.wq_b = ReplicatedLinear(dims.q_lora_rank, dims.num_heads * dims.head_dim)
        self.wk = ReplicatedLinear(dims.hidden_size, dims.head_dim)
        self.k_norm = nn.LayerNorm(dims.head_dim, eps=KEY_NORM_EPS)
        self.weights_proj = Float32Router(dims.hidden_size, dims.num_heads)
        self.weight_scale = dims.num_heads ** -0.5 * dims.head_dim ** -0.5
        # Bound by the MLA layer once the pool exists.
        self.cache: IndexerCache | None = None

    def key_cache_specs(self, config: CacheConfig) -> tuple[PagedCacheSpec, ...]:
        dtype = config.indexer_key_dtype()
        if self.pooling is not None:
            if dtype == FP8:
                raise OptionError("--indexer-cache-dtype fp8 is not implemented for pooled index groups "
                                  "(index_kpool, GLM-5.3); use auto or bfloat16")
            return (PagedCacheSpec(POOLED_KIND, 2, (self.dims.head_dim,), dtype),)  # planes: keys, gate logits
        keys = PagedCacheSpec(KIND, 1, (self.dims.head_dim,), dtype)
        if dtype != FP8:
            return (keys,)
        return keys, PagedCacheSpec(KIND, 1, (1,), torch.float32)

    def bind(self, tensors: tuple[torch.Tensor, ...] | None) -> None:
        """The tensors of key_cache_specs ([1, blocks, block_size, D], then [1, blocks, block_size, 1])."""
        if tensors is None:
            self.cache = None
            return
        if self.pooling is not None:
            self.cache = IndexerCache(tensors[0][0], pool_gates=tensors[0][1])
            return
        scales = tensors[1][0, ..., 0] if len(tensors) > 1 else None
        self.cache = IndexerCache(tensors[0][0], scales)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor,
                rotary: nn.Module) -> torch.Tensor:
        """hidden [T, hidden_size], q_resid [T, q_lora_rank]; `rotary`: the MLA layer's rotary
        embedding (qk_rope_head_dim wide; None without rope). Writes the step's keys, returns int32
        [T, index_topk] (pooled: [T, pooling.width(index_topk)])."""
        if self.cache is None:
            raise RuntimeError("the indexer cache is not bound")
        d = self.dims
        ctx = get_forward_context()
        backend, metadata = ctx.backends[self.kind], ctx.metadata[self.kind]
        q = self.wq_b(q_resid).view(-1, d.num_heads, d.head_dim)
        k = self.k_norm(self.wk(hidden)).unsqueeze(1)
        if d.rope_dim:
            q, k = self._rope(positions, q, k, rotary)
        weights = self.weights_proj(hidden) * self.weight_scale
        if self.pooling is None:
            backend.write_keys(k.squeeze(1), self.cache, metadata.slot_mapping)
            return backend.select(q, weights, self.cache, metadata, d.index_topk)
        gates = torch.nn.functional.linear(hidden, self.index_kpool_compress_gate)
        backend.write_keys(k.squeeze(1), gates, self.cache, metadata.slot_mapping)
        return backend.select(q, weights, self.cache, metadata, d.index_topk, self.pooling,
                              self.index_kpool_compress_ape)

    def _rope(self, positions, q, k, rotary):
        """q [T, H, D], k [T, 1, D] -> both with their first rope_dim dims rotated."""
        r = self.dims.rope_dim
        q_rot, k_rot = q[..., :r], k[..., :r]
        if self.rope_interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        # Copies: the rotary may work in place, and these are views into q and k.
        q_rot, k_rot = rotary(positions, q_rot.contiguous(), k_rot.contiguous())
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
