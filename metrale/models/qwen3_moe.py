"""Qwen3-MoE (and Qwen2-MoE): Qwen's attention with sparse mixture-of-experts blocks.

Layer i is sparse when i is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0;
otherwise it has a dense SwiGLU MLP of `intermediate_size`. A sparse block routes each token
to its top `num_experts_per_tok` of `num_experts` experts (softmax scores, renormalised when
`norm_topk_prob`), each a SwiGLU of `moe_intermediate_size`. When the config has a
`shared_expert_intermediate_size` (Qwen2-MoE, Qwen3-Next) every token also passes through a
shared expert, scaled by sigmoid(shared_expert_gate(x)), added to the routed output.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.linear import ReplicatedLinear
from metrale.layers.mlp import GatedMLP
from metrale.layers.moe import FusedMoE
from metrale.models.llama import LlamaAttention, LlamaForCausalLM
from metrale.models.qwen3 import Qwen3Attention


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: ModelConfig, renormalize: bool | None = None):
        """`renormalize`: whether the top-k weights are divided by their sum (default: the config's
        norm_topk_prob)."""
        super().__init__()
        hf, hidden = config.hf_config, config.hidden_size
        if renormalize is None:
            renormalize = bool(getattr(hf, "norm_topk_prob", False))
        self.gate = ReplicatedLinear(hidden, hf.num_experts, bias=False, quantizable=False)
        self.experts = FusedMoE(hf.num_experts, hf.num_experts_per_tok, hidden, hf.moe_intermediate_size,
                                scoring="softmax", renormalize=renormalize)
        shared = getattr(hf, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = GatedMLP(hidden, shared) if shared else None
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, quantizable=False) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts.forward_routed_by(hidden, self.gate)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


def is_sparse_layer(hf_config, layer_index: int) -> bool:
    return (layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0 and (layer_index + 1) % getattr(hf_config, "decoder_sparse_step", 1) == 0)


def sparse_or_dense_mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    hf = config.hf_config
    if is_sparse_layer(hf, layer_index):
        return Qwen3MoeSparseBlock(config)
    return GatedMLP(config.hidden_size, hf.intermediate_size)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    mtp_layout = None  # met's dense MTP layout is not defined for MoE layers

    def make_attention(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return Qwen3Attention(config, layer_index)

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return self.decoder_layer(config, self.make_attention(config, layer_index),
                                  sparse_or_dense_mlp(config, layer_index))


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: no q/k norm, a bias on Q, K and V (`qkv_bias`), and usually a shared expert."""

    def make_attention(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaAttention(config, layer_index, qkv_bias=getattr(config.hf_config, "qkv_bias", True), o_bias=False)
