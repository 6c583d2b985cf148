"""Tiny random GLM-5.3 checkpoints (`Glm5NextForConditionalGeneration`, a vision tower of one
block included), written by `transformers` itself.

Four layers: KDA, MLA with a full indexer, MLA sharing that selection, KDA; a dense MLP in layer
0 and MoE after it (8 experts in 4 groups, 2 kept, a shared expert). 3 attention heads and 3 KDA
heads, so two TP ranks split both unevenly (2/1). The indexer: 16 heads of 32 dims, index groups
of 4 positions (index_kpool), index_topk 24 (6 groups, plus the row's own incomplete group), so
every prompt of 28+ tokens attends to a strict subset of its positions. swiglu_limit 1.0, low
enough that the clamps change many values.

transformers' init leaves the hyper-connections' base at 0 and scale at 1, the pooling's
bias at 0 and its gate at 1, the norms at 1 and the decay at fixed values: those are drawn at
random here, so a checkpoint tells a missed or misplaced term. The pad token's embedding is
made non-zero, as in dsa_checkpoints.py (a zero hidden state would score every group 0).
"""

from __future__ import annotations

import torch

from checkpoints import VOCAB_SIZE, save_random_model

INDEX_TOPK, INDEX_KPOOL = 24, 4

TEXT = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=48, kv_lora_rank=32,
            qk_rope_head_dim=0, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
            index_topk=INDEX_TOPK, index_n_heads=16, index_head_dim=32, index_kpool=INDEX_KPOOL,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            linear_num_heads=3, linear_head_dim=16, linear_conv_kernel_dim=4, hc_mult=4, hc_sinkhorn_iters=20,
            swiglu_limit=1.0)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)

# variant -> text config overrides: the softplus decay (no lower bound) and no tail selection.
VARIANTS = {
    "glm5_next": {},
    "glm5_next_softplus_no_tail": dict(linear_lower_bound=None, index_kpool_always_select_tail=False),
}


def _edit(model):
    text = model.model.language_model
    embedding = text.embed_tokens.weight
    embedding[text.config.pad_token_id] = torch.randn(embedding.shape[1]) * text.config.initializer_range
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape) * 0.5)
    for name, param in model.named_parameters():
        if name.startswith("model.visual."):
            continue
        if name.endswith(("hc.base", "index_kpool_compress_ape", "k_norm.bias")):
            param.copy_(torch.randn(param.shape) * 0.5)
        elif name.endswith(("hc.scale", "norm.weight")):
            param.copy_(1.0 + torch.randn(param.shape) * 0.3)
        elif name.endswith("index_kpool_compress_gate"):
            param.copy_(torch.randn(param.shape) * 0.2)
        elif name.endswith(("A_log", "dt_bias")):
            param.copy_(torch.randn(param.shape) * 0.5)


def make_glm5_next_checkpoint(path: str, variant: str = "glm5_next", seed: int = 0, **overrides) -> str:
    def configure(config):
        # save_random_model sets the tokenizer's ids at the top level; the text model reads its own.
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            setattr(config.text_config, name, getattr(config, name))

    fields = dict(text_config={**TEXT, **VARIANTS[variant], **overrides}, vision_config=VISION,
                  tie_word_embeddings=False)
    return save_random_model(path, "Glm5NextConfig", "Glm5NextForConditionalGeneration", fields, seed, edit=_edit,
                             configure=configure)


def load_glm5_next_reference(path: str):
    """transformers has no causal-LM auto class for glm5_next: the multimodal model, text only."""
    import transformers

    return transformers.Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
