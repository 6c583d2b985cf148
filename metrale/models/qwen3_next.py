"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention) and gated full attention, with
sparse MoE blocks that add a gated shared expert.

    layer i:  zero-centred RMSNorm -> token mixer -> residual
              zero-centred RMSNorm -> MoE (softmax top-k + sigmoid-gated shared expert) -> residual
    mixer:    GatedDeltaNet where config.layer_types[i] == "linear_attention" (3 of every 4),
              else gated attention: q and its output gate packed per head in q_proj, zero-centred
              RMSNorm of each q and k head, RoPE on the first partial_rotary_factor of each head,
              attention, then out * sigmoid(gate) before o_proj.

Every norm stores its weight zero-centred (scale 1 + w). The checkpoints' `mtp.*` tensors (a
multi-token-prediction layer: a full-attention decoder layer with layer 0's MLP) load into
`model.mtp` for the MTP drafter of speculative decoding (models/qwen_mtp.py); the main forward
never runs them.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.attention import Attention
from metrale.layers.linear import QKVParallelLinear, RowParallelLinear
from metrale.layers.linear_attention import GatedDeltaNet
from metrale.layers.norm import ZeroCentredRMSNorm
from metrale.layers.rotary import RotaryEmbedding, rope_parameters
from metrale.models.common import CausalLM
from metrale.models.qwen3_moe import sparse_or_dense_mlp
from metrale.models.qwen_mtp import attach_qwen_mtp_layers, declared_qwen_mtp_layers


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        hf, head_dim = config.hf_config, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_kv_heads, bias=getattr(hf, "attention_bias", False), q_per_head=2)
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=False,
                                        input_partition=self.qkv_proj.query_partition(head_dim))
        self.q_norm = ZeroCentredRMSNorm(head_dim, hf.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, hf.rms_norm_eps)
        rotary_dim = int(head_dim * rope_parameters(hf).get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(hf, head_dim, config.max_model_len, rotary_dim=rotary_dim)
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.qkv_proj.num_kv_heads, layer_index,
                              rotary=self.rotary_emb, qk_norm=(self.q_norm, self.k_norm))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        kv_size = self.qkv_proj.kv_size
        q_and_gate, k, v = self.qkv_proj(hidden).split([self.qkv_proj.q_size, kv_size, kv_size], dim=-1)
        q, gate = q_and_gate.view(-1, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        out = self.attn(positions, q, k, v)
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


def token_mixer(config: ModelConfig, layer_index: int) -> tuple[nn.Module, str]:
    """The layer's mixer and its checkpoint name."""
    kind = config.hf_config.layer_types[layer_index]
    if kind == "linear_attention":
        return GatedDeltaNet(config, layer_index), "linear_attn"
    if kind == "full_attention":
        return GatedAttention(config, layer_index), "self_attn"
    raise ValueError(f"layer {layer_index}: layer type {kind!r} is not supported (linear_attention, full_attention)")


class Qwen3NextForCausalLM(CausalLM):
    norm = ZeroCentredRMSNorm
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
                      ("in_proj", "in_proj_qkvz", "qkvz"), ("in_proj", "in_proj_ba", "ba")]
    declared_mtp_layers = staticmethod(declared_qwen_mtp_layers)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        attach_qwen_mtp_layers(self, config)

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        mixer, name = token_mixer(config, layer_index)
        return self.decoder_layer(config, mixer, sparse_or_dense_mlp(config, layer_index), name)

    def mtp_mlp(self, config: ModelConfig) -> nn.Module:
        """The MTP layer's MLP: layer 0's kind (vLLM builds it from the layer's own index, 0)."""
        return sparse_or_dense_mlp(config, 0)

    def make_mtp_block(self, config: ModelConfig, cache_index: int) -> nn.Module:
        """The MTP decoder layer: gated full attention whose cache is layer `cache_index`'s (no
        trunk layer's number), the MLP of `mtp_mlp`."""
        return self.decoder_layer(config, GatedAttention(config, cache_index), self.mtp_mlp(config), "self_attn")
