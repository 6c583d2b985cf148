"""Qwen3: Llama's block with RMSNorm over each head of Q and K before RoPE, and no QKV bias."""

from __future__ import annotations

from metrale.config.model_config import ModelConfig
from metrale.kernels import use_triton
from metrale.layers.norm import RMSNorm
from metrale.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig):
        bias = getattr(config.hf_config, "attention_bias", False)
        super().__init__(config, qkv_bias=bias, o_bias=bias)
        # Both norms share one eps (the fused kernel takes a single eps).
        self.q_norm = RMSNorm(config.head_dim, config.hf_config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.hf_config.rms_norm_eps)

    def transform_qk(self, q, k):
        return self.q_norm(q), self.k_norm(k)

    def per_head_qk_norms(self):
        return self.q_norm, self.k_norm

    def rotate_qk(self, positions, q, k):
        """On the Triton path, q/k norms and RoPE in one launch (in place, same numerics as the
        norm kernel followed by the rotary kernel); elsewhere the unfused modules."""
        if not use_triton(q):
            return super().rotate_qk(positions, q, k)
        from metrale.kernels.qk_norm_rope import qk_norm_rope_triton

        rope = self.rotary_emb
        return qk_norm_rope_triton(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                   rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig):
        return Qwen3Attention(config)
