"""DeepSeek-V3: multi-head latent attention in every layer, dense SwiGLU MLPs in the first
`first_k_dense_replace` layers and DeepSeek MoE blocks after them.

    layer i:  RMSNorm -> MLAAttention (layers/mla) -> residual
              RMSNorm -> GatedMLP (i < first_k_dense_replace) or the MoE block -> residual
    MoE:      a float32 router; sigmoid scores, the experts chosen by score + e_score_correction_bias
              among each token's topk_group best of n_group expert groups, weighted by their
              unbiased scores (renormalised when norm_topk_prob) times routed_scaling_factor;
              plus n_shared_experts shared experts as one SwiGLU every token passes through.

MLA as transformers' DeepseekV3Attention: q_lora_rank None means one plain q_proj; q_a_layernorm
and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says (the reference never passes it);
RoPE on the qk_rope_head_dim part only, interleaved when rope_interleave; the softmax scale is
qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under a scaled rope with a
non-zero mscale_all_dim (yarn).

Checkpoint names are transformers' (DeepSeek's own): the router `mlp.gate.weight` with its
`mlp.gate.e_score_correction_bias` (ours lives on the experts), `mlp.shared_experts.*`, experts
per expert. The multi-token-prediction layers (`model.layers.{num_hidden_layers + i}.*`, i below
num_nextn_predict_layers) load into `model.mtp` where the checkpoint holds them (hashed, not run:
models/mtp.py), and are ignored where it does not. Options this implementation does not run are
refused by name (`unsupported_options`).

Block-FP8 weights (DeepSeek's published checkpoints: [128, 128] blocks, float32 weight_scale_inv)
load through the shared quantization pass: every MLA projection, the dense and shared-expert
MLPs and the routed experts are FP8; the float32 router and its correction bias, the norms,
embeddings and LM head are not (a router stored in FP8 is refused, naming the tensor). How MLA
reads an FP8 kv_b_proj: layers/mla/layer.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from metrale.config.model_config import ModelConfig, ModelLoadError
from metrale.layers.mla import MLAAttention, MLADims
from metrale.layers.mlp import GatedMLP
from metrale.layers.moe import FusedMoE
from metrale.layers.moe.router import Float32Router
from metrale.layers.rotary import RotaryEmbedding, rope_parameters
from metrale.models.common import CausalLM
from metrale.models.mtp import attach_mtp_layers, declared_mtp_layers

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's, as the reference builds them


def unsupported_options(hf) -> list[str]:
    """The config's options this implementation would run wrong, each as `name=value`."""
    found = []
    for name, supported in (("hidden_act", ("silu",)), ("attention_bias", (False,)), ("scoring_func", ("sigmoid",)),
                            ("topk_method", ("noaux_tc",)), ("moe_layer_freq", (1,))):
        value = getattr(hf, name, supported[0])
        if value not in supported:
            found.append(f"{name}={value!r}")
    return found


def mla_softmax_scale(hf) -> float:
    scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def make_mla(config: ModelConfig, layer_index: int, **dsa) -> MLAAttention:
    """`dsa`: MLAAttention's indexer or selection_source (DeepSeek-V3.2, GLM-5: models/deepseek_v32.py)."""
    hf = config.hf_config
    dims = MLADims(config.hidden_size, hf.num_attention_heads, hf.q_lora_rank, hf.kv_lora_rank,
                   hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)
    rotary = RotaryEmbedding(hf, hf.qk_rope_head_dim, config.max_model_len)
    return MLAAttention(dims, layer_index, rotary, mla_softmax_scale(hf), LATENT_NORM_EPS,
                        rope_interleaved=bool(getattr(hf, "rope_interleave", True)), **dsa)


class DeepseekV3MoE(nn.Module):
    def __init__(self, config: ModelConfig, swiglu_limit: float | None = None):
        """`swiglu_limit`: gate and up clamped in the experts and the shared experts (GLM-5.3)."""
        super().__init__()
        hf, hidden = config.hf_config, config.hidden_size
        self.gate = Float32Router(hidden, hf.n_routed_experts)
        self.experts = FusedMoE(hf.n_routed_experts, hf.num_experts_per_tok, hidden, hf.moe_intermediate_size,
                                scoring="sigmoid", renormalize=bool(hf.norm_topk_prob), use_correction_bias=True,
                                num_expert_groups=hf.n_group or 1, topk_groups=hf.topk_group or 1,
                                routed_scaling_factor=hf.routed_scaling_factor, swiglu_limit=swiglu_limit)
        shared = hf.moe_intermediate_size * (hf.n_shared_experts or 0)
        self.shared_experts = GatedMLP(hidden, shared, swiglu_limit=swiglu_limit) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


def deepseek_mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    """A dense SwiGLU in the first `first_k_dense_replace` layers, the DeepSeek MoE block after."""
    hf = config.hf_config
    if layer_index < (hf.first_k_dense_replace or 0):
        return GatedMLP(config.hidden_size, hf.intermediate_size)
    return DeepseekV3MoE(config)


class DeepseekV3ForCausalLM(CausalLM):
    """The DeepSeek-V3 trunk; GLM-4.5 (models/glm4_moe.py) is the same with its own attention."""

    stacked_params = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    checkpoint_renames = ((".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"),)
    declared_mtp_layers = staticmethod(declared_mtp_layers)  # num_nextn_predict_layers (models/mtp.py)

    def __init__(self, config: ModelConfig):
        unsupported = self.unsupported_options(config)
        if unsupported:
            raise ModelLoadError(f"{config.architecture}: config options met does not implement: "
                                 f"{', '.join(unsupported)}")
        super().__init__(config)
        attach_mtp_layers(self, config)

    @staticmethod
    def unsupported_options(config: ModelConfig) -> list[str]:
        return unsupported_options(config.hf_config)

    def make_mixer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return make_mla(config, layer_index)

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return self.decoder_layer(config, self.make_mixer(config, layer_index), deepseek_mlp(config, layer_index))
