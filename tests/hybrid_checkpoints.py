"""Tiny random hybrid (linear + full attention) checkpoints, written by `transformers` itself.

Same recipe as checkpoints.py (trained byte-level tokenizer, transformers' own random init with
initializer_range 0.2, float32 safetensors), for Qwen3-Next and Qwen3.5. Four layers alternate
Gated DeltaNet and gated attention; transformers initialises the zero-centred norms to zero and
the decay parameters to fixed ranges, so those are perturbed here, or a checkpoint would not
tell a (1 + w) norm from a plain one.
"""

from __future__ import annotations

import os

import torch

from checkpoints import VOCAB_SIZE, save_random_model

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
               initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False, full_attention_interval=2,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

HYBRID_FAMILIES = {
    # Layers 0 and 2 linear attention, 1 and 3 gated attention; sparse MoE in every layer but 3.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[3])),
    # Dense MLPs, the linear-attention projections stored apart.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    # MoE in every layer.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _MOE),
}


def make_hybrid_checkpoint(path: str, family: str, seed: int = 0, **overrides) -> str:
    config_name, model_name, extra = HYBRID_FAMILIES[family]

    def edit(model):
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape) * 0.3)  # zero-centred norms: scales 1 + w
            elif name.endswith(("A_log", "dt_bias")):
                param.copy_(torch.randn(param.shape) * 0.5)

    return save_random_model(path, config_name, model_name, {**_COMMON, **extra, **overrides}, seed, edit=edit)

def write_reference_set(directory: str) -> None:
    """Each family's checkpoint under directory/<family>, with transformers' greedy tokens for
    the GPU tests' prompts in directory/<family>/expected.json: the GPU machine's transformers may
    not know the newest families, so their reference is computed where it does."""
    import json

    from checkpoints import load_reference, reference_greedy

    for family in HYBRID_FAMILIES:
        path = make_hybrid_checkpoint(os.path.join(directory, family), family)
        model = load_reference(path)
        expected = [reference_greedy(model, p, GPU_NEW_TOKENS) for p in gpu_prompts()]
        with open(os.path.join(path, "expected.json"), "w") as f:
            json.dump(expected, f)


GPU_NEW_TOKENS = 12


def gpu_prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (1, 3, 17, 64, 100, 181, 250)]


# Speculative decoding's checkpoints (tests/models/test_speculative_hybrid.py, tests/gpu): at the
# usual initializer_range 0.2 a tiny random model is so chaotic that prompt lookup almost never
# guesses right; at 0.05 its continuations fall into short repeats now and then, so drafts are
# accepted in some steps and rejected in others, while the context still decides the tokens.
SPEC_INITIALIZER_RANGE = 0.05


def spec_prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    drawn = [[rng.randrange(3, 384) for _ in range(rng.choice([2, 5, 9, 20]))] for _ in range(12)]
    # Prompts 6, 8 and 11 fall into repeats that prompt lookup drafts; 45 tokens cross block boundaries.
    return [drawn[i] for i in (0, 3, 6, 8, 11)] + [[rng.randrange(3, 384) for _ in range(45)]]


if __name__ == "__main__":  # python tests/hybrid_checkpoints.py DIR
    import sys

    write_reference_set(sys.argv[1])
