"""The `mtp.*` multi-token-prediction (MTP) layer: loaded, hashed and run by the MTP drafter of
speculative decoding (executor/drafters/mtp.py), as DeepSeek's next-n layers are (models/mtp.py),
in the layout Qwen published for Qwen3-Next and Qwen3.5 (dense and MoE), which met also defines
for its dense families (Llama, Qwen2, Qwen3: `DENSE_LAYOUT`):

    mtp.pre_fc_norm_embedding   RMSNorm of the next token's embedding
    mtp.pre_fc_norm_hidden      RMSNorm of the trunk's hidden state
    mtp.fc                      Linear 2H -> H, no bias, over [embedding half, hidden half] (replicated)
    mtp.layers.0.*              one decoder layer (`model.make_mtp_block`): Qwen3-Next / Qwen3.5's
                                has FULL (gated) attention and the model's MLP of layer 0 (Qwen3-Next:
                                the sparse MoE block with its gated shared expert; Qwen3.5 dense: the
                                SwiGLU; Qwen3.5 MoE: its MoE block); a dense family's is its own
                                decoder layer, under transformers' names (self_attn.q_proj, ...,
                                mlp.gate_proj, ..., input_layernorm, post_attention_layernorm)
    mtp.norm                    RMSNorm after the layer

The norms are the family's own (`MTPLayout.norm`): zero-centred (1 + w) for the Qwen hybrids,
standard (w) for the dense families. The embedding and the LM head are the target's
(`mtp_use_dedicated_embeddings` false in the published configs; true is refused by name). The
concat order, embedding first, is vLLM's (qwen3_next_mtp.py / qwen3_5_mtp.py).

Forward at position p (`QwenMTPLayer.forward`): x = fc([pre_fc_norm_embedding(embed(t_{p+1})),
pre_fc_norm_hidden(h_p)]) with h_p the trunk's final hidden state (after its last norm); the
decoder layer runs at position p over its own paged KV cache (layer number num_hidden_layers, no
trunk layer's); the layer's hidden state is norm(out + residual): that is both what the head reads
(the target's lm_head, no further norm) and the `h` of the next chained pass (as vLLM chains it).

How many layers (`MTPLayout.declared`): Qwen's `mtp_num_hidden_layers` (Qwen3.5's published
configs: 1), else `num_nextn_predict_layers`, else 1 (Qwen3-Next-80B's config names neither and
its checkpoint holds one layer); a dense family's `num_nextn_predict_layers`, else 0 (transformers
ignores the key: the dense layout is met's own, no published checkpoint has it). Held where the
checkpoint has `mtp.layers.0.*`, or always under `--load-format dummy` (the dummy checkpoint
draws the `mtp.*` tensors: `QwenMTPLayer.dummy_checkpoint_shapes`): loaded into `model.mtp[0]`,
the checkpoint's `mtp.` renamed to `mtp.0.`. A config that declares none, more than one layer, or dedicated embeddings loads without
MTP (the `mtp.*` tensors ignored) and `method: "mtp"` is refused naming why
(`model.mtp_unavailable`).

Hash: sha256 over every `mtp.*` tensor as stored (models/mtp.py's rule), `model.mtp_sha256`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.linear import ReplicatedLinear
from metrale.layers.norm import RMSNorm, ZeroCentredRMSNorm
from metrale.models.mtp import (DECODER_PARTS, copied_layer_shapes, drawing_dummy_weights, held_checkpoint_names,
                                mark_drafter_only, trunk_prefix)

CHECKPOINT_PREFIX = "mtp."


@dataclass(frozen=True)
class MTPLayout:
    """What differs between the families that store an `mtp.*` layer: the config fields that
    declare the layer count (the first one set wins), the count when none is set, the norm class."""

    count_fields: tuple[str, ...]
    default_count: int
    norm: type[nn.Module]

    def declared(self, config: ModelConfig) -> int:
        return self.declared_by(config)[1]

    def declared_by(self, config: ModelConfig) -> tuple[str, int]:
        """(how the config says it: "field N", or "field not set"; the count)."""
        for name in self.count_fields:
            value = getattr(config.hf_config, name, None)
            if value is not None:
                return f"{name} {int(value)}", int(value)
        return f"{self.count_fields[0]} not set", self.default_count


QWEN_LAYOUT = MTPLayout(("mtp_num_hidden_layers", "num_nextn_predict_layers"), 1, ZeroCentredRMSNorm)
DENSE_LAYOUT = MTPLayout(("num_nextn_predict_layers",), 0, RMSNorm)


def declared_qwen_mtp_layers(config: ModelConfig) -> int:
    return QWEN_LAYOUT.declared(config)


def attention_source(config: ModelConfig) -> int | None:
    """The trunk layer whose attention the MTP layer's is shaped like, for dummy weights: the first
    full-attention one of a hybrid's layer_types (its MLP and norms are layer 0's kind); 0 for a
    dense trunk; None where a hybrid trunk cut by --hf-overrides keeps no full-attention layer."""
    hf = config.hf_config
    types = list(getattr(hf, "layer_types", None) or [])[:hf.num_hidden_layers]
    if not types:
        return 0
    return types.index("full_attention") if "full_attention" in types else None


class QwenMTPLayer(nn.Module):
    """fc([pre_fc_norm_embedding(embed(next token)), pre_fc_norm_hidden(hidden)]) -> decoder layer
    -> norm (the module docstring). `block`: the decoder layer, kept as `layers[0]` for the
    checkpoint's names; `norm`: the family's RMSNorm class."""

    def __init__(self, config: ModelConfig, block: nn.Module, norm: type[nn.Module] = ZeroCentredRMSNorm):
        super().__init__()
        hidden, eps = config.hidden_size, config.hf_config.rms_norm_eps
        self.pre_fc_norm_embedding = norm(hidden, eps)
        self.pre_fc_norm_hidden = norm(hidden, eps)
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([block])
        self.norm = norm(hidden, eps)
        mark_drafter_only(block)
        self.attention_source = attention_source(config)  # for dummy weights
        self.hidden_size = hidden

    @property
    def block(self) -> nn.Module:
        return self.layers[0]

    def cached_layers(self) -> list:
        return [m for m in self.block.modules() if hasattr(m, "cache_specs")]

    def dummy_checkpoint_shapes(self, index: int, reference_shapes: dict) -> dict:
        """`--load-format dummy`: the `mtp.*` names and shapes, mtp.layers.0's shaped on the
        reference's trunk layers (attention: `attention_source`'s; MLP and norms: layer 0's)."""
        trunk, h = trunk_prefix(reference_shapes), self.hidden_size
        target = CHECKPOINT_PREFIX + "layers.0."
        shapes = copied_layer_shapes(reference_shapes, f"{trunk}layers.0.", target,
                                     [p for p in DECODER_PARTS if p != "self_attn"])
        shapes.update(copied_layer_shapes(reference_shapes, f"{trunk}layers.{self.attention_source}.", target,
                                          ["self_attn"]))
        shapes.update({f"{CHECKPOINT_PREFIX}{norm}.weight": (h,)
                       for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
        shapes[f"{CHECKPOINT_PREFIX}fc.weight"] = (h, 2 * h)
        return shapes

    def forward(self, positions: torch.Tensor, next_token_ids: torch.Tensor, hidden: torch.Tensor,
                embed_tokens: nn.Module) -> torch.Tensor:
        """The layer's (normed) hidden state at each row; runs inside a forward context."""
        embedding = embed_tokens(next_token_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedding), self.pre_fc_norm_hidden(hidden)], dim=-1))
        out, residual = self.block(positions, x, None)
        normed, _ = self.norm(out, residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head.compute_logits(hidden)


def unavailable_reason(config: ModelConfig, layout: MTPLayout = QWEN_LAYOUT) -> str | None:
    """Why a checkpoint's `mtp.*` tensors are not loaded, or None where they are (if held)."""
    said, declared = layout.declared_by(config)
    if declared == 0:
        return f"its config declares no MTP layers ({said})"
    if declared > 1:
        return (f"its config declares {declared} MTP layers ({said}); met drafts with the one-layer `mtp.*` "
                "layout only")
    if getattr(config.hf_config, "mtp_use_dedicated_embeddings", False):
        return ("its config sets mtp_use_dedicated_embeddings, a layout met has not seen published: the MTP layer's "
                "own embedding is not loaded")
    return None


def attach_qwen_mtp_layers(model: nn.Module, config: ModelConfig, layout: MTPLayout = QWEN_LAYOUT) -> None:
    """A family's __init__, after the trunk: `model.mtp` where the checkpoint holds
    `mtp.layers.0.*` and the layout is the one-layer one; else the `mtp.*` tensors ignored (with
    `model.mtp_unavailable` saying why, for the drafter's refusal). `layout`: the family's."""
    model.mtp_sha256, model.mtp_tensor_count = None, 0
    model.mtp_checkpoint_prefixes = ()
    reason = unavailable_reason(config, layout)
    if reason is None and drawing_dummy_weights() and attention_source(config) is None:
        reason = ("--load-format dummy: the trunk keeps no full-attention layer to shape the dummy MTP layer's "
                  "attention on (num_hidden_layers below full_attention_interval)")
    held = drawing_dummy_weights() or any(name.startswith(CHECKPOINT_PREFIX + "layers.0.")
                                          for name in held_checkpoint_names())
    if reason is None and held:
        block = model.make_mtp_block(config, config.hf_config.num_hidden_layers)
        model.mtp = nn.ModuleList([QwenMTPLayer(config, block, layout.norm)])
        model.checkpoint_renames = type(model).checkpoint_renames + ((CHECKPOINT_PREFIX, "mtp.0."),)
        model.mtp_checkpoint_prefixes = (CHECKPOINT_PREFIX,)
        return
    model.ignored_checkpoint_prefixes = type(model).ignored_checkpoint_prefixes + (CHECKPOINT_PREFIX,)
    if reason is not None:
        model.mtp_unavailable = reason
