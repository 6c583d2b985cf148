"""Tiny random DeepSeek-V3.2 and GLM-5 (DSA) checkpoints, written by `transformers` itself.

The MLA and MoE shapes of tests/mla_checkpoints.py (three or four layers, layer 0 dense, 8
routed experts in 4 groups, a shared expert, a non-zero correction bias), plus the lightning
indexer: 16 heads of 32 dims (the first 16 roped), index_topk 24, so every prompt of 25+
tokens attends to a strict subset of its positions.

Ties: relu zeroes a head's term whenever q . k <= 0, and a score is exactly 0 when every head's
is; with few heads that is common, and a tie at the top-k boundary lets transformers and met
keep different positions, both correctly. 16 heads make an exact zero about a 2 ** -16 event
per (row, position), and the random k_norm, weights_proj and init scale spread the scores, so
the selections here have no ties at the boundary (the selection tests check the margin).

GLM-5's config has both kinds of layer: indexer_types full, shared, full, shared.
"""

from __future__ import annotations

import torch

from checkpoints import VOCAB_SIZE, save_random_model
from mla_checkpoints import DEEPSEEK_V3

INDEX_TOPK = 24

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
               n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
               norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=512,
               initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False,
               index_topk=INDEX_TOPK, index_n_heads=16, index_head_dim=32)

# family -> (config class, model class, fields, seed). GLM-5's seed 0 checkpoint has two logits
# within float rounding of each other at one greedy step (a near-tie of the model, not of the
# selection), so it takes seed 1.
DSA_FAMILIES = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", {}, 0),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]), 1),
}

# DeepSeek-V3.2-Exp's config.json: DeepSeek-V3's shapes and its indexer's (index_* as published).
DEEPSEEK_V32 = dict(DEEPSEEK_V3, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                    index_n_heads=64, index_head_dim=128, index_topk=2048)


def make_dsa_checkpoint(path: str, family: str = "deepseek_v32", seed: int | None = None, **overrides) -> str:
    config_name, model_name, fields, family_seed = DSA_FAMILIES[family]

    def edit(model):
        # transformers zeroes the pad token's embedding (padding_idx), and the models here do
        # generate it: a zero hidden state gives zero indexer weights, every score 0, and a
        # selection that is all ties. A random row keeps every selection tie-free.
        embedding = model.model.embed_tokens.weight
        embedding[model.config.pad_token_id] = torch.randn(embedding.shape[1]) * model.config.initializer_range
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape) * 0.5)
        for name, param in model.named_parameters():
            if name.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight", "k_norm.weight")):
                param.copy_(1.0 + torch.randn(param.shape) * 0.3)  # not all ones: a missed norm shows
            elif name.endswith("k_norm.bias"):
                param.copy_(torch.randn(param.shape) * 0.3)  # not zero: a missed bias shows

    return save_random_model(path, config_name, model_name, {**_COMMON, **fields, **overrides},
                             family_seed if seed is None else seed, edit=edit)
