"""The trunk every decoder-only family here shares, composed from the parts a family chooses:

    embed_tokens -> layers[i] = DecoderLayer(mixer_i, mlp_i) -> norm -> lm_head

A DecoderLayer is the pre-norm residual block: norm, token mixer (attention, or a linear-
attention layer), residual add fused into the next norm, MLP (dense or mixture of experts). A
family is a `make_layer(config, layer_index)` and, when its checkpoint names differ from ours,
`stacked_params` and `checkpoint_renames`.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.norm import RMSNorm
from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float, mixer: nn.Module, mlp: nn.Module, mixer_name: str = "self_attn",
                 norm: type[nn.Module] = RMSNorm):
        """`mixer_name`: the checkpoint's name of the token mixer (self_attn, linear_attn)."""
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = norm(hidden_size, eps)
        self.post_attention_layernorm = norm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = getattr(self, self.mixer_name)(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    # Layers whose outputs (the residual stream after them) a forward pass keeps in
    # `layer_outputs` for a runner-side drafter that reads them (executor/drafters/base.py).
    output_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, make_layer, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.layer_outputs: dict[int, torch.Tensor] = {}
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_layers))
        self.norm = norm(config.hidden_size, config.hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i in self.output_layers:
                self.layer_outputs[i] = hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    # Checkpoint projections that live stacked in one of our parameters: (ours, theirs, shard).
    stacked_params: list[tuple[str, str, object]] = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    # (checkpoint substring, ours), applied in order to every checkpoint name before mapping.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # Checkpoint tensors the model does not use, by name prefix (e.g. multi-token-prediction heads).
    ignored_checkpoint_prefixes: tuple[str, ...] = ()
    norm: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.make_layer, self.norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf_config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        raise NotImplementedError

    def decoder_layer(self, config: ModelConfig, mixer: nn.Module, mlp: nn.Module,
                      mixer_name: str = "self_attn") -> DecoderLayer:
        return DecoderLayer(config.hidden_size, config.hf_config.rms_norm_eps, mixer, mlp, mixer_name, self.norm)

    @property
    def tied_embeddings(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
