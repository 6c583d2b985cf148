"""Qwen3: Llama's block with RMSNorm over each head of Q and K before RoPE, and no QKV bias."""

from __future__ import annotations

from metrale.config.model_config import ModelConfig
from metrale.layers.norm import RMSNorm
from metrale.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig):
        bias = getattr(config.hf_config, "attention_bias", False)
        super().__init__(config, qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(config.head_dim, config.hf_config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.hf_config.rms_norm_eps)

    def transform_qk(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig):
        return Qwen3Attention(config)
