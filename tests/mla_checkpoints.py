"""Tiny random DeepSeek-V3 (MLA) checkpoints, written by `transformers` itself.

Same recipe as checkpoints.py (trained byte-level tokenizer, transformers' own random init with
initializer_range 0.2 so greedy picks are clear-cut, float32 safetensors). Three layers: layer 0
dense (first_k_dense_replace=1), layers 1-2 mixture of experts with 8 routed experts in 4 groups
(2 groups kept per token, 2 experts per token), a shared expert, and a non-zero correction bias
(transformers initialises it to zero; a real one changes which experts win). MLA: kv_lora_rank
32, qk_rope 16, qk_nope 32, v_head_dim 32; the two variants differ in the query path (a low-rank
q_a/q_b pair with its norm, or one plain q_proj).
"""

from __future__ import annotations

import torch

from checkpoints import VOCAB_SIZE, save_random_model

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
               kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
               n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
               norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
               max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)

MLA_FAMILIES = {
    # The low-rank query (q_a_proj -> q_a_layernorm -> q_b_proj), interleaved rope, as DeepSeek-V3.
    "deepseek_v3": dict(q_lora_rank=48),
    # One plain q_proj (DeepSeek-V2-Lite's shape), rope not interleaved, no renormalisation.
    "deepseek_v3_plain_q": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False),
}

# DeepSeek-V3's config.json as published, without its quantization_config (DEEPSEEK_V3_FP8 has it).
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=163840,
    rms_norm_eps=1e-6, vocab_size=129280, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
    num_nextn_predict_layers=1, tie_word_embeddings=False, torch_dtype="bfloat16", rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                      original_max_position_embeddings=4096))
DEEPSEEK_V3_FP8 = dict(DEEPSEEK_V3, quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                                           weight_block_size=[128, 128]))


def make_mla_checkpoint(path: str, family: str = "deepseek_v3", seed: int = 0, **overrides) -> str:
    def edit(model):
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape) * 0.5)
        for name, param in model.named_parameters():
            if name.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight")):
                param.copy_(1.0 + torch.randn(param.shape) * 0.3)  # not all ones: a missed norm shows

    fields = {**_COMMON, **MLA_FAMILIES[family], **overrides}
    return save_random_model(path, "DeepseekV3Config", "DeepseekV3ForCausalLM", fields, seed, edit=edit)
