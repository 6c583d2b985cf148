"""MLAAttention: multi-head latent attention (DeepSeek-V2/V3 and the families built on it), the
whole token mixer: projections, norms, RoPE, the latent cache, attention, output projection.

    q          = q_b_proj(q_a_layernorm(q_a_proj(x)))  or  q_proj(x) without a q_lora_rank,
                 heads of [qk_nope | qk_rope]
    [c | k_pe] = kv_a_proj_with_mqa(x);  c_kv = kv_a_layernorm(c)
    RoPE on q's rope part and on k_pe (one head, shared by every query head)
    cache     <- [c_kv | k_pe] per token
    heads      = attention over the context's latents (layers/mla/backend.py: up-projected
                 through kv_b_proj for prefill, absorbed for decode), v_head_dim each
    out        = o_proj(heads)

Submodules carry the checkpoint's names (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). The post-load hook splits kv_b_proj's
weight into W_UK [heads, qk_nope, rank] and W_UV [heads, v, rank] for the absorbed form: views of
that weight, so no second copy exists and the memory plan's weight bytes stay exact.

FP8 weights (layers/quantization): every projection is a met linear layer, so the quantization
pass makes each FP8 like any other, and the forward runs them through their own matmuls
(kv_b_proj's included: the up-projected form calls the layer). The absorbed form needs W_UK and
W_UV as plain tensors, so when kv_b_proj is FP8 the post-load hook dequantizes its weight once
(its scale layout: weight_scale_inv, group_n, block_k) into one copy in the model dtype, and
W_UK / W_UV are views of that copy: heads x (qk_nope + v) x rank values per layer and rank (32 MiB
on DeepSeek-V3 in bfloat16), which `derived_weight_bytes` reports to the memory plan. Nothing
else reads a projection's weight directly.

It is a CachedLayer of kind "mla": one paged spec of one plane of [kv_lora_rank +
qk_rope_head_dim] per token in the model dtype, under the block table every paged cache shares.
With --kv-cache-dtype fp8 the plane is float8_e4m3fn with one scale per layer (`latent_scale`:
stored = value / scale, saturated at +-448; the checkpoint's `k_scale` of that model layer, else
1.0), as MHA's K/V; `--kv-cache-dtype-skip-layers` keeps chosen layers in the model dtype.

Tensor parallelism: heads split over the ranks, as evenly as possible where they do not divide
(q_b_proj / q_proj and kv_b_proj column-parallel, their rows head-major; o_proj row-parallel,
every rank its heads' columns); q_a_proj, kv_a_proj_with_mqa and both norms are
replicated, so the latent, and so the cache, is the same on every rank.

RoPE, as transformers' DeepseekV3Attention: with `rope_interleaved` (rope_interleave, DeepSeek's
checkpoints) dimension pairs (0, 1), (2, 3), ... share a frequency, and the rotated vector comes
out de-interleaved ([rotated evens | rotated odds]); the layer de-interleaves before a neox
rotation, which computes exactly that. Without it, a plain neox rotation.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a layer built with an `indexer`
(layers/mla/indexer.py, a "full" layer) runs it on the step's hidden states and q_resid
(q_a_layernorm's output), and its attention sees only the positions it selects. Its caches are
then the latent spec and, after it, the indexer's specs (kind "indexer": keys, and with fp8 their
scales), bound in that order. A layer built with `selection_source` (a "shared" layer, GLM-5)
has no indexer and no indexer cache: it attends over the selection that model layer's indexer
made in this step. The selection travels in the step's indexer metadata (IndexerMetadata.
selections), not through the model's layer loop: it is per-step state like the rest of the
forward context, it is dropped with the step, and the decoder trunk every family shares stays
free of a DSA-only argument. Layers run in model order, so the full layer has always run first;
a missing entry is a wiring bug and fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metrale.config.cache_config import FP8, CacheConfig
from metrale.distributed.head_split import is_uneven, per_rank, scaled, split_heads
from metrale.distributed.parallel_state import get_tp_group
from metrale.kernels.fp8_math import dequantize_weight
from metrale.layers.cache_spec import PagedCacheSpec
from metrale.layers.forward_context import get_forward_context
from metrale.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from metrale.layers.mla.backend import LatentUpProjection
from metrale.layers.mla.indexer import KIND as INDEXER_KIND
from metrale.layers.mla.indexer import DSAIndexer
from metrale.layers.norm import RMSNorm
from metrale.layers.rotary import deinterleave

KIND = "mla"


@dataclass(frozen=True)
class MLADims:
    hidden_size: int
    num_heads: int  # all ranks together
    q_lora_rank: int | None  # None: one plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One token's cache entry: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class MLAAttention(nn.Module):
    def __init__(self, dims: MLADims, layer_index: int, rotary: nn.Module, scale: float,
                 latent_norm_eps: float = 1e-6, rope_interleaved: bool = False, indexer: DSAIndexer | None = None,
                 selection_source: int | None = None, selection_kind: str = INDEXER_KIND):
        """`rotary`: a neox-style RotaryEmbedding of qk_rope_head_dim (None when that is 0: no
        RoPE, GLM-5.3); `scale`: the softmax scale
        (qk_head_dim ** -0.5, times any yarn mscale the model applies); `latent_norm_eps`: the
        eps of q_a_layernorm and kv_a_layernorm. DSA (module docstring): `indexer` for a full
        layer, or `selection_source`, the model layer number of the full layer a shared one
        reuses (an earlier layer), whose indexer's cache kind is `selection_kind` (the metadata
        its selection travels in: "indexer", or "pooled_indexer" for GLM-5.3's)."""
        super().__init__()
        if indexer is not None and selection_source is not None:
            raise ValueError(f"MLA layer {layer_index}: an indexer or a shared selection, not both")
        if selection_source is not None and not selection_source < layer_index:
            raise ValueError(f"MLA layer {layer_index} cannot reuse the selection of layer {selection_source}: "
                             f"only an earlier layer's")
        if indexer is not None and dims.q_lora_rank is None:
            raise ValueError(f"MLA layer {layer_index}: the DSA indexer reads q_a_layernorm's output, "
                             f"which needs a q_lora_rank")
        self.dims, self.layer_index, self.scale = dims, layer_index, scale
        self.rope_interleaved = rope_interleaved
        tp = get_tp_group()
        # Heads split as evenly as possible (distributed/head_split.py); every per-head projection
        # takes the same per-rank head counts, the latent stays whole.
        self.heads_per_rank = split_heads(dims.num_heads, tp.size, "MLA attention heads")
        self.num_heads = self.heads_per_rank[tp.rank]
        q_rows = scaled(self.heads_per_rank, dims.qk_head_dim)
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(dims.hidden_size, dims.num_heads * dims.qk_head_dim,
                                               output_partition=q_rows)
        else:
            self.q_a_proj = ReplicatedLinear(dims.hidden_size, dims.q_lora_rank)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, latent_norm_eps)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, dims.num_heads * dims.qk_head_dim,
                                                 output_partition=q_rows)
        self.kv_a_proj_with_mqa = ReplicatedLinear(dims.hidden_size, dims.latent_dim)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, latent_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank, dims.num_heads * (dims.qk_nope_head_dim
                                                                                   + dims.v_head_dim),
                                              output_partition=scaled(self.heads_per_rank, dims.qk_nope_head_dim
                                                                      + dims.v_head_dim))
        self.o_proj = RowParallelLinear(dims.num_heads * dims.v_head_dim, dims.hidden_size,
                                        input_partition=scaled(self.heads_per_rank, dims.v_head_dim))
        self.rotary_emb = rotary
        self.indexer = indexer
        self.selection_source = selection_source
        self.selection_kind = selection_kind
        # The model dtype (construction runs under it): what an FP8 kv_b_proj is dequantized to.
        self.model_dtype = torch.get_default_dtype()
        # Set by the post-load hook: kv_b_proj as the backends read it.
        self.up: LatentUpProjection | None = None
        # Bound by the model runner once the pool exists: [num_blocks, block_size, latent_dim].
        self.latent_cache: torch.Tensor | None = None
        # An fp8 latent cache's scale (stored value = value / scale): the checkpoint's k_scale of
        # this model layer (loader/kv_scales.py) or 1.0. A plain float: CUDA graphs bake it in.
        self.latent_scale = 1.0

    # -- the cache ---------------------------------------------------------------------------

    def cache_specs(self, config: CacheConfig) -> tuple[PagedCacheSpec, ...]:
        latent = PagedCacheSpec(KIND, 1, (self.dims.latent_dim,), config.kv_dtype(self.layer_index))
        if self.indexer is None:
            return (latent,)
        return (latent, *self.indexer.key_cache_specs(config))

    def bind_caches(self, caches: tuple[torch.Tensor, ...] | None) -> None:
        self.latent_cache = None if caches is None else caches[0][0]
        if self.latent_cache is not None and self.latent_cache.dtype != FP8:  # a scale means something only to fp8
            self.latent_scale = 1.0
        if self.indexer is not None:
            self.indexer.bind(None if caches is None else caches[1:])

    # -- weights -----------------------------------------------------------------------------

    def process_weights_after_loading(self) -> None:
        """W_UK and W_UV from kv_b_proj: views of its weight, or of one dequantized copy when it is
        FP8 (runs after kv_b_proj's own hook has settled its scale layout)."""
        d, kv_b = self.dims, self.kv_b_proj
        weight = kv_b.weight
        if kv_b.fp8 is not None:
            weight = dequantize_weight(weight, kv_b.weight_scale_inv, kv_b.fp8.group_n, kv_b.fp8.block_k,
                                       self.model_dtype)
        weight = weight.view(self.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        self.up = LatentUpProjection(kv_b, weight[:, :d.qk_nope_head_dim], weight[:, d.qk_nope_head_dim:])

    def uneven_head_split(self) -> str | None:
        """What the startup log says of this layer's split; None when it is even."""
        return f"heads {per_rank(self.heads_per_rank)} per rank" if is_uneven(self.heads_per_rank) else None

    def derived_weight_bytes(self) -> int:
        """Bytes the post-load hook adds beyond the parameters (the memory plan counts them, from
        the meta-device build): the dequantized copy of an FP8 kv_b_proj, else nothing."""
        if self.kv_b_proj.fp8 is None:
            return 0
        rows, cols = self.kv_b_proj.weight.shape
        return rows * cols * (torch.finfo(self.model_dtype).bits // 8)

    # -- the forward pass --------------------------------------------------------------------

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size] (summed over the TP ranks)."""
        if self.latent_cache is None:
            raise RuntimeError(f"the latent cache is not bound to the MLA attention of layer {self.layer_index}")
        d = self.dims
        ctx = get_forward_context()
        backend, metadata = ctx.backends[KIND], ctx.metadata[KIND]
        if not d.qk_rope_head_dim and not backend.supports_nope:
            raise NotImplementedError(f"MLA without RoPE (qk_rope_head_dim 0, GLM-5.3) has no {backend.name} kernels "
                                      f"yet; run with --attention-backend torch")
        q_resid = None if d.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(hidden))
        q = (self.q_proj(hidden) if q_resid is None else self.q_b_proj(q_resid)).view(-1, self.num_heads, d.qk_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        if d.qk_rope_head_dim:
            q_pe, k_pe = self._rope(positions, q_pe, k_pe.unsqueeze(1))
        else:
            k_pe = k_pe.unsqueeze(1)
        backend.write_latent(kv_c, k_pe.squeeze(1), self.latent_cache, metadata.slot_mapping, self.latent_scale)
        topk_indices = self._selection(ctx, positions, hidden, q_resid)
        heads = backend.forward(q_nope, q_pe, self.latent_cache, self.up, metadata, self.scale, topk_indices,
                                latent_scale=self.latent_scale)
        return self.o_proj(heads.reshape(-1, self.num_heads * d.v_head_dim))

    def _selection(self, ctx, positions, hidden, q_resid) -> torch.Tensor | None:
        """The positions each row attends to (DSA), or None for dense attention."""
        if self.indexer is not None:
            selection = self.indexer(positions, hidden, q_resid, self.rotary_emb)
            ctx.metadata[self.indexer.kind].selections[self.layer_index] = selection
            return selection
        if self.selection_source is not None:
            selections = ctx.metadata[self.selection_kind].selections
            if self.selection_source not in selections:
                raise RuntimeError(f"MLA layer {self.layer_index} reuses layer {self.selection_source}'s selection, "
                                   f"which this step has not made")
            return selections[self.selection_source]
        return None

    def _rope(self, positions, q_pe, k_pe):
        """q_pe [T, heads, rope], k_pe [T, 1, rope] -> both rotated (the rotary may work in place:
        the views' columns are read as nothing else)."""
        if self.rope_interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        return self.rotary_emb(positions, q_pe, k_pe)
