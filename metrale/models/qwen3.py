"""Qwen3: Llama's block with RMSNorm over each head of Q and K before RoPE, and no QKV bias."""

from __future__ import annotations

from metrale.config.model_config import ModelConfig
from metrale.layers.norm import RMSNorm
from metrale.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_index: int):
        hf = config.hf_config
        bias = getattr(hf, "attention_bias", False)
        # Both norms share one eps (the fused prologue kernel takes a single eps).
        q_norm, k_norm = RMSNorm(config.head_dim, hf.rms_norm_eps), RMSNorm(config.head_dim, hf.rms_norm_eps)
        super().__init__(config, layer_index, qkv_bias=bias, o_bias=bias, qk_norm=(q_norm, k_norm))
        self.q_norm, self.k_norm = q_norm, k_norm


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig, layer_index: int):
        return Qwen3Attention(config, layer_index)
