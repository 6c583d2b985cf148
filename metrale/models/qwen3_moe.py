"""Qwen3-MoE (and Qwen2-MoE): Qwen's attention with sparse mixture-of-experts blocks.

Layer i is sparse when i is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0;
otherwise it has a dense SwiGLU MLP of `intermediate_size`. A sparse block routes each token
to its top `num_experts_per_tok` of `num_experts` experts (softmax scores, renormalised when
`norm_topk_prob`), each a SwiGLU of `moe_intermediate_size`. When the config has a
`shared_expert_intermediate_size` (Qwen2-MoE) every token also passes through a shared expert,
scaled by sigmoid(shared_expert_gate(x)), added to the routed output.

The generic pieces every MoE family here reuses (a decoder layer around any attention and MLP,
the model trunk, and the checkpoint mapping of expert tensors) live in this file too.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.linear import ReplicatedLinear
from metrale.layers.moe import FusedMoE
from metrale.layers.norm import RMSNorm
from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from metrale.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from metrale.models.qwen3 import Qwen3Attention


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual block (and its forward) around a given attention and MLP."""

    def __init__(self, config: ModelConfig, attention: nn.Module, mlp: nn.Module):
        nn.Module.__init__(self)  # LlamaDecoderLayer.__init__ would build a dense MLP we do not want
        eps = config.hf_config.rms_norm_eps
        self.self_attn, self.mlp = attention, mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


class MoEModel(LlamaModel):
    """Llama's trunk (and its forward) with layers from `make_layer(config, layer_idx)`."""

    def __init__(self, config: ModelConfig, make_layer):
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps)


class MoECausalLM(LlamaForCausalLM):
    """A causal LM whose layers come from `make_layer`; expert tensors load through FusedMoE."""

    # (checkpoint substring, ours), applied in order to every checkpoint name before mapping.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        self.model = MoEModel(config, self.make_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf_config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        raise NotImplementedError


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hf, hidden = config.hf_config, config.hidden_size
        self.gate = ReplicatedLinear(hidden, hf.num_experts, bias=False)
        self.experts = FusedMoE(hf.num_experts, hf.num_experts_per_tok, hidden, hf.moe_intermediate_size,
                                scoring="softmax", renormalize=bool(getattr(hf, "norm_topk_prob", False)))
        shared = getattr(hf, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = LlamaMLP(hidden, shared) if shared else None
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


def is_sparse_layer(hf_config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0 and (layer_idx + 1) % getattr(hf_config, "decoder_sparse_step", 1) == 0)


class Qwen3MoeForCausalLM(MoECausalLM):
    def make_attention(self, config: ModelConfig) -> nn.Module:
        return Qwen3Attention(config)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        hf = config.hf_config
        if is_sparse_layer(hf, layer_idx):
            mlp = Qwen3MoeSparseBlock(config)
        else:
            mlp = LlamaMLP(config.hidden_size, hf.intermediate_size)
        return MoEDecoderLayer(config, self.make_attention(config), mlp)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: no q/k norm, a bias on Q, K and V (`qkv_bias`), and usually a shared expert."""

    def make_attention(self, config: ModelConfig) -> nn.Module:
        return LlamaAttention(config, qkv_bias=getattr(config.hf_config, "qkv_bias", True), o_bias=False)
