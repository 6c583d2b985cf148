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
