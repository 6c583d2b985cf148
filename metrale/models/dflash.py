"""The DFlash drafter (z-lab's block-diffusion drafter): a few decoder layers that draft a whole
block of tokens in one pass, conditioned on the target model's hidden states.

    context   = hidden_norm(fc(concat of the target's hidden states after its layers
                target_layer_ids)), one row per position the target has computed
    block     = embed(last sampled token, mask, mask, ..., mask)   block_size rows, the target's
                embedding, at positions p .. p + block_size - 1 (p: the sampled token's position)
    layers[i] = pre-norm residual block; its attention's queries are the block rows, its keys and
                values those of the context rows (positions 0 .. p - 1) followed by the block's own,
                every block row seeing every key (no causal mask)
    drafts    = argmax of the target's LM head over norm(output) at block rows 1 .. k

Each layer projects the same context with its own k_proj / v_proj (then k_norm and RoPE at the
context position); the context is never run through the layers. So a layer's context K/V of a
position never changes once computed: it is kept in a paged cache like the target's K/V (one spec
of two planes per drafter layer, in the same block table, written for every position the target
computes), and a draft pass computes only the block. A rejected draft's context row is written
like the target's K/V of that position and overwritten the same way once the position is
recomputed; a draft pass reads context only below its block, which is all accepted.

Checkpoint names (the z-lab layout): `fc.weight`, `hidden_norm.weight`, `norm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config.cache_config import CacheConfig
from metrale.config.dflash_config import DFlashConfig
from metrale.layers.attention.torch_backend import gather_context, write_kv_reference
from metrale.layers.cache_spec import PagedCacheSpec
from metrale.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from metrale.layers.mlp import GatedMLP
from metrale.layers.norm import RMSNorm
from metrale.layers.rotary import RotaryEmbedding

KIND = "attention"  # the drafter's context K/V share the target's block tables


@dataclass
class DraftBlocks:
    """One draft pass: `num_blocks` requests, each `block_size` query rows (request i's rows
    i * block_size .. (i + 1) * block_size - 1), its block at positions context_lens[i] onwards.
    `context_bounds` (host ints, each >= context_lens[i]) say how much of the cache to gather;
    the keys from context_lens[i] up are masked, so the lengths themselves stay on the device."""

    positions: torch.Tensor  # [num_blocks * block_size]
    block_tables: torch.Tensor  # [num_blocks, width] int32: the requests' KV blocks
    context_lens: torch.Tensor  # [num_blocks] int64: positions of context each block reads (its first position)
    context_bounds: list[int]
    block_size: int


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_index: int, max_position: int):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_heads, config.num_kv_heads,
                                          bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_heads * head_dim, config.hidden_size, bias=config.attention_bias,
                                        input_partition=self.qkv_proj.query_partition(head_dim))
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.hf_config, head_dim, max_position)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, self.scale = head_dim, head_dim ** -0.5
        self.layer_index = layer_index  # past the target's layers: its own number in the cache layout
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- the cache: this layer's K/V of every context position -------------------------------

    def cache_specs(self, config: CacheConfig) -> tuple[PagedCacheSpec]:
        # The model dtype whatever --kv-cache-dtype says: the drafter has no calibrated fp8 scales.
        return (PagedCacheSpec(KIND, 2, (self.num_kv_heads, self.head_dim), config.model_dtype),)

    def bind_caches(self, caches: tuple[torch.Tensor, ...] | None) -> None:
        self.kv_cache = None if caches is None else (caches[0][0], caches[0][1])

    def _qkv(self, hidden: torch.Tensor, positions: torch.Tensor):
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def write_context(self, context: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.kv_cache is None:
            raise RuntimeError(f"the DFlash context cache of drafter layer {self.layer_index} is not bound")
        _, k, v = self._qkv(context, positions)
        write_kv_reference(k, v, *self.kv_cache, slot_mapping)

    # -- a draft pass --------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, blocks: DraftBlocks) -> torch.Tensor:
        q, k, v = self._qkv(hidden, blocks.positions)
        k_cache, v_cache = self.kv_cache
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        n = blocks.block_size
        block_keys = torch.ones(n, dtype=torch.bool, device=q.device)
        for i, bound in enumerate(blocks.context_bounds):
            rows = slice(i * n, (i + 1) * n)
            keys = torch.cat([gather_context(k_cache, blocks.block_tables[i], bound).to(q.dtype), k[rows]])
            values = torch.cat([gather_context(v_cache, blocks.block_tables[i], bound).to(q.dtype), v[rows]])
            keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, bound + block, d]
            values = values.transpose(0, 1).repeat_interleave(group, dim=0)
            seen = torch.cat([torch.arange(bound, device=q.device) < blocks.context_lens[i], block_keys])
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, attn_mask=seen, scale=self.scale)
            out[rows] = o.transpose(0, 1)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_index: int, max_position: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_index, max_position)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, blocks: DraftBlocks):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, blocks)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DFlashDraftModel(nn.Module):
    """The drafter's own weights. The embedding and LM head are the target's, passed to `draft`
    (not submodules: the drafter checkpoint does not hold them)."""

    # Checkpoint projections stacked in one parameter: (ours, theirs, shard), as the families'.
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, config: DFlashConfig, first_layer_index: int, max_position: int):
        """`first_layer_index`: the cache layout's number of drafter layer 0 (the target's layer
        count, so the drafter's numbers follow the target's)."""
        super().__init__()
        self.dflash_config = config
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, first_layer_index + i, max_position)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)

    def write_context(self, target_hidden: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """Every layer's context K/V of these positions into its cache. `target_hidden`: [T,
        len(target_layer_ids) x hidden], the target's hidden states of those positions after
        each target layer the drafter reads, concatenated in target_layer_ids' order."""
        context = self.hidden_norm(self.fc(target_hidden))
        for layer in self.layers:
            layer.self_attn.write_context(context, positions, slot_mapping)

    def forward(self, block_embeddings: torch.Tensor, blocks: DraftBlocks) -> torch.Tensor:
        """The normed output of every block row."""
        hidden, residual = block_embeddings, None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, blocks)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def draft(self, first_tokens: torch.Tensor, blocks: DraftBlocks, embed_tokens: nn.Module, lm_head: nn.Module,
              num_drafts: int, vocab_size: int | None = None) -> torch.Tensor:
        """[num_blocks, num_drafts] greedy drafts: each block is its request's last sampled token
        (`first_tokens`, on the device) and block_size - 1 mask tokens; draft j is the argmax at
        block row j + 1, over ids below `vocab_size` (None: all). The whole block is always run
        (its rows see each other, so a shorter block would draft other tokens than the drafter
        was trained to)."""
        n = blocks.block_size
        if not 1 <= num_drafts <= n - 1:
            raise ValueError(f"a DFlash block of {n} drafts 1..{n - 1} tokens, not {num_drafts}")
        ids = torch.full((first_tokens.shape[0], n), self.dflash_config.mask_token_id, dtype=torch.int64,
                         device=first_tokens.device)
        ids[:, 0] = first_tokens
        hidden = self(embed_tokens(ids.reshape(-1)), blocks).reshape(-1, n, self.dflash_config.hidden_size)
        logits = lm_head.compute_logits(hidden[:, 1:num_drafts + 1].reshape(-1, hidden.shape[-1]))
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        return logits.argmax(dim=-1).reshape(-1, num_drafts)
