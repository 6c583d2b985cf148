"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): GQA attention with partial rotary embeddings, dense
SwiGLU MLPs in the first `first_k_dense_replace` layers and DeepSeek-V3's MoE block after them.

    layer i:  RMSNorm -> attention -> residual
              RMSNorm -> GatedMLP (i < first_k_dense_replace) or the MoE block -> residual

Attention, as transformers' Glm4MoeAttention: q/k/v projections with a bias when
`attention_bias` (o_proj never has one); with `use_qk_norm` an RMSNorm over each head of Q and K
(rms_norm_eps, before RoPE, as Qwen3); RoPE on the first head_dim * partial_rotary_factor dims of
each head, half-split (neox, rotate_half) over those dims, the rest passed through; scale
head_dim ** -0.5.

The MoE block is transformers' Glm4MoeMoE, which is DeepSeek-V3's (its modular source derives it
from DeepseekV3MoE) and runs as `deepseek_v3.DeepseekV3MoE` (the trunk is DeepseekV3ForCausalLM's, with this attention): a float32 router, sigmoid scores,
experts chosen by score + e_score_correction_bias among each token's topk_group best of n_group
groups, weighted by the unbiased scores (renormalised when norm_topk_prob) times
routed_scaling_factor, plus n_shared_experts shared experts as one SwiGLU.

Checkpoint names are transformers' (ZhipuAI's own): q_proj/k_proj/v_proj (stacked into qkv_proj),
`mlp.gate.weight` with `mlp.gate.e_score_correction_bias` (ours lives on the experts),
`mlp.shared_experts.*`, experts per expert. The multi-token-prediction (next-n) layers
(`model.layers.{num_hidden_layers + i}.*`, i below num_nextn_predict_layers) load into `model.mtp`
where the checkpoint holds them (hashed, not run: models/mtp.py), and are ignored where it does
not. Options this implementation does not run are refused by name (`unsupported_options`).
"""

from __future__ import annotations

from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.norm import RMSNorm
from metrale.layers.rotary import rope_parameters
from metrale.models.common import CausalLM
from metrale.models.deepseek_v3 import DeepseekV3ForCausalLM
from metrale.models.llama import LlamaAttention


def rotary_dim_of(config: ModelConfig) -> int:
    """head_dim * partial_rotary_factor, as the reference's rotary embedding computes it."""
    factor = rope_parameters(config.hf_config).get("partial_rotary_factor", 1.0)
    return int(config.head_dim * factor)


def unsupported_options(config: ModelConfig) -> list[str]:
    """The config's options this implementation would run wrong, each as `name=value` (hidden_act
    is checked for every family at startup)."""
    hf, found = config.hf_config, []
    rotary_dim = rotary_dim_of(config)
    if not (0 < rotary_dim <= config.head_dim and rotary_dim % 2 == 0):
        factor = rope_parameters(hf).get("partial_rotary_factor", 1.0)
        found.append(f"partial_rotary_factor={factor!r} (rotary dim {rotary_dim} of head_dim {config.head_dim})")
    return found


class Glm4MoeAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_index: int):
        hf = config.hf_config
        qk_norm = None
        if getattr(hf, "use_qk_norm", False):
            # Both norms share one eps (the fused prologue kernel takes a single eps).
            qk_norm = (RMSNorm(config.head_dim, hf.rms_norm_eps), RMSNorm(config.head_dim, hf.rms_norm_eps))
        super().__init__(config, layer_index, qkv_bias=bool(getattr(hf, "attention_bias", False)), o_bias=False,
                         qk_norm=qk_norm, rotary_dim=rotary_dim_of(config))
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    stacked_params = CausalLM.stacked_params  # q/k/v and gate/up
    unsupported_options = staticmethod(unsupported_options)

    def make_mixer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return Glm4MoeAttention(config, layer_index)
