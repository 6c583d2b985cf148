"""Llama and Qwen2: pre-norm decoder blocks of GQA attention with RoPE and a SwiGLU MLP.

Qwen2 is Llama with a bias on the Q, K and V projections; Llama-3 adds rope scaling (handled by
the RotaryEmbedding from the config). Qwen3 (qwen3.py) adds per-head RMSNorm on Q and K.

A config declaring `num_nextn_predict_layers: 1` over a checkpoint holding `mtp.*` tensors gets
met's own dense MTP layer (models/qwen_mtp.py's DENSE_LAYOUT: the family's decoder layer and
RMSNorm) in `model.mtp`, for the MTP drafter only; the main forward never runs it.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.attention import Attention
from metrale.layers.linear import QKVParallelLinear, RowParallelLinear
from metrale.layers.mlp import GatedMLP
from metrale.layers.rotary import RotaryEmbedding
from metrale.models.common import CausalLM
from metrale.models.qwen_mtp import DENSE_LAYOUT, MTPLayout, attach_qwen_mtp_layers


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, qkv_bias: bool, o_bias: bool,
                 qk_norm: tuple[nn.Module, nn.Module] | None = None, rotary_dim: int | None = None):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias,
                                        input_partition=self.qkv_proj.query_partition(head_dim))
        self.rotary_emb = RotaryEmbedding(config.hf_config, head_dim, config.max_model_len, rotary_dim=rotary_dim)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim ** -0.5, self.qkv_proj.num_kv_heads,
                              layer_index, rotary=self.rotary_emb, qk_norm=qk_norm)

    def split_qkv(self, hidden: torch.Tensor):
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        return self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(positions, *self.split_qkv(hidden)))


class LlamaForCausalLM(CausalLM):
    # The `mtp.*` layout of the family's MTP layer; None: the family has none (a subclass whose
    # decoder layer met has not tested as an MTP layer), and `mtp.*` tensors are not taken.
    mtp_layout: MTPLayout | None = DENSE_LAYOUT

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        if self.mtp_layout is not None:
            attach_qwen_mtp_layers(self, config, self.mtp_layout)

    @classmethod
    def declared_mtp_layers(cls, config: ModelConfig) -> int:
        return cls.mtp_layout.declared(config) if cls.mtp_layout is not None else 0

    def make_mtp_block(self, config: ModelConfig, cache_index: int) -> nn.Module:
        """The MTP decoder layer: the family's own, its attention's cache layer `cache_index`."""
        return self.make_layer(config, cache_index)

    def make_attention(self, config: ModelConfig, layer_index: int) -> nn.Module:
        bias = getattr(config.hf_config, "attention_bias", False)
        return LlamaAttention(config, layer_index, qkv_bias=bias, o_bias=bias)

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        hf = config.hf_config
        mlp = GatedMLP(config.hidden_size, hf.intermediate_size, bias=getattr(hf, "mlp_bias", False))
        return self.decoder_layer(config, self.make_attention(config, layer_index), mlp)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaAttention(config, layer_index, qkv_bias=True, o_bias=False)
