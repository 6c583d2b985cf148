"""MiniMax-M2: GQA attention with RMSNorm over the *whole* Q and K projections (not per head) and
partial rotary embeddings, and a sparse MoE block in every layer.

Attention, as transformers' MiniMaxM2Attention: q = q_norm(q_proj(x)) over all heads at once
(k likewise over all KV heads), then heads, then neox RoPE on the first
rotary_dim = head_dim * partial_rotary_factor dims of each head (config.json's `rotary_dim`),
scale head_dim ** -0.5, no biases.

Routing: sigmoid scores in float32; the experts are chosen by score + e_score_correction_bias,
weighted by the unbiased scores of the chosen ones renormalised to sum to one (always).
Checkpoints name the block `block_sparse_moe` and its experts w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.distributed.parallel_state import get_tp_group
from metrale.layers.linear import ReplicatedLinear
from metrale.layers.moe import FusedMoE
from metrale.layers.rotary import rope_parameters
from metrale.models.common import CausalLM
from metrale.models.llama import LlamaAttention


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over a projection whose heads are split over the TP ranks: the mean square is taken
    over the full width, summing each rank's part. `replicas` ranks hold the same KV heads when
    there are fewer KV heads than ranks; their sums are counted once."""

    def __init__(self, full_size: int, local_size: int, eps: float, shard_index: int = 0, replicas: int = 1):
        super().__init__()
        self.tp = get_tp_group()
        self.full_size, self.eps, self.shard_index, self.replicas = full_size, eps, shard_index, replicas
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        if tuple(loaded.shape) != (self.full_size,):
            raise ValueError(f"norm weight shape {tuple(loaded.shape)} does not match ({self.full_size},)")
        param.data.copy_(loaded.narrow(0, self.shard_index * param.shape[0], param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp.size == 1:
            mean_square = h.pow(2).mean(-1, keepdim=True)
        else:
            mean_square = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / (self.replicas * self.full_size)
        return self.weight * (h * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class MiniMaxM2Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_index: int):
        hf, head_dim, tp = config.hf_config, config.head_dim, get_tp_group()
        rotary_dim = int(head_dim * rope_parameters(hf).get("partial_rotary_factor", 1.0))
        super().__init__(config, layer_index, qkv_bias=False, o_bias=False, rotary_dim=rotary_dim)
        if self.qkv_proj.split.uneven:  # the full-width norms slice their weight in equal shards
            raise ValueError(f"{config.num_attention_heads} attention heads and {config.num_kv_heads} KV heads split "
                             f"unevenly over tp_size={tp.size} ({self.qkv_proj.split.describe()}), which MiniMax-M2's "
                             f"full-width q/k norms do not support yet; use a tp size that divides the heads")
        replicas = max(1, tp.size // config.num_kv_heads)
        self.q_norm = FullWidthRMSNorm(config.num_attention_heads * head_dim, self.qkv_proj.q_size,
                                       hf.rms_norm_eps, shard_index=tp.rank)
        self.k_norm = FullWidthRMSNorm(config.num_kv_heads * head_dim, self.qkv_proj.kv_size,
                                       hf.rms_norm_eps, shard_index=tp.rank // replicas, replicas=replicas)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden)  # q and k normalised over their whole (full-width) projection
        return self.o_proj(self.attn(positions, self.q_norm(q), self.k_norm(k), v))


class MiniMaxM2SparseBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hf = config.hf_config
        self.gate = ReplicatedLinear(config.hidden_size, hf.num_local_experts, bias=False, quantizable=False)
        self.experts = FusedMoE(hf.num_local_experts, hf.num_experts_per_tok, config.hidden_size,
                                hf.intermediate_size, scoring="sigmoid", renormalize=True, use_correction_bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class MiniMaxM2ForCausalLM(CausalLM):
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),
                          (".mlp.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"))

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return self.decoder_layer(config, MiniMaxM2Attention(config, layer_index), MiniMaxM2SparseBlock(config))
