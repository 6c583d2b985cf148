"""Tiny random mixture-of-experts checkpoints, written by `transformers` itself.

Same recipe as checkpoints.py (trained byte-level tokenizer, transformers' own random init with
initializer_range 0.2 so greedy picks are clear-cut, float32 safetensors), for the MoE families.
transformers 5.x saves experts per expert in the original hub layout (Qwen: mlp.experts.{e}.
gate_proj/up_proj/down_proj; MiniMax-M2: block_sparse_moe.experts.{e}.w1/w3/w2), which is
what met's loader must read.
"""

from __future__ import annotations

import torch

from checkpoints import VOCAB_SIZE, save_random_model

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
               num_experts_per_tok=2, tie_word_embeddings=False)

MOE_FAMILIES = {
    # Layer 0 sparse, layer 1 dense (mlp_only_layers), softmax routing renormalised over the top 2.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=8, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1])),
    # Sigmoid routing with a (non-zero, set below) correction bias, partial rotary, full-width q/k norm.
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        head_dim=32, rotary_dim=16, num_local_experts=8, intermediate_size=32)),
    # A shared expert with a sigmoid gate, Q/K/V bias, no renormalisation.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, moe_intermediate_size=32, intermediate_size=96, shared_expert_intermediate_size=48,
        norm_topk_prob=False)),
    # GLM-4.5: layer 0 dense (first_k_dense_replace), layer 1 DeepSeek-style MoE (8 routed experts in
    # 4 groups, 2 kept per token, a shared expert, sigmoid scores with a correction bias, scaled),
    # Q/K/V bias, per-head q/k norm, RoPE on half of each head.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=32, intermediate_size=96, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=8,
        n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True)),
    # GLM-4.5 without q/k norms (use_qk_norm False), one expert group, a quarter of each head rotated.
    "glm4_moe_no_qk_norm": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=32, intermediate_size=96, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=8,
        n_group=1, topk_group=1, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.5,
        partial_rotary_factor=0.25, use_qk_norm=False, attention_bias=True)),
}


def make_moe_checkpoint(path: str, family: str, seed: int = 0, **overrides) -> str:
    config_name, model_name, extra = MOE_FAMILIES[family]

    def edit(model):
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # transformers initialises it to zero; a real one changes which experts win.
                buffer.copy_(torch.rand(buffer.shape) * 0.5)
        if model_name == "Glm4MoeForCausalLM":
            for name, param in model.named_parameters():
                if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                    param.copy_(1.0 + torch.randn(param.shape) * 0.3)  # not all ones: a missed norm shows

    return save_random_model(path, config_name, model_name, {**_COMMON, **extra, **overrides}, seed, edit=edit)
