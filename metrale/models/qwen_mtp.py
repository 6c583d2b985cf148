"""The multi-token-prediction (MTP) layer of Qwen3-Next and Qwen3.5 (dense and MoE) checkpoints:
loaded, hashed and run by the MTP drafter of speculative decoding (executor/drafters/mtp.py), as
DeepSeek's next-n layers are (models/mtp.py), in Qwen's own layout:

    mtp.pre_fc_norm_embedding   zero-centred RMSNorm of the next token's embedding
    mtp.pre_fc_norm_hidden      zero-centred RMSNorm of the trunk's hidden state
    mtp.fc                      Linear 2H -> H, no bias, over [embedding half, hidden half] (replicated)
    mtp.layers.0.*              one decoder layer with FULL (gated) attention and the model's MLP
                                of layer 0 (Qwen3-Next: the sparse MoE block with its gated shared
                                expert; Qwen3.5 dense: the SwiGLU; Qwen3.5 MoE: its MoE block)
    mtp.norm                    zero-centred RMSNorm after the layer

The embedding and the LM head are the target's (`mtp_use_dedicated_embeddings` false in the
published configs; true is refused by name). The concat order, embedding first, is vLLM's
(qwen3_next_mtp.py / qwen3_5_mtp.py).

Forward at position p (`QwenMTPLayer.forward`): x = fc([pre_fc_norm_embedding(embed(t_{p+1})),
pre_fc_norm_hidden(h_p)]) with h_p the trunk's final hidden state (after its last norm); the
decoder layer runs at position p over its own paged KV cache (layer number num_hidden_layers, no
trunk layer's); the layer's hidden state is norm(out + residual): that is both what the head reads
(the target's lm_head, no further norm) and the `h` of the next chained pass (as vLLM chains it).

How many layers: `mtp_num_hidden_layers` (Qwen3.5's published configs: 1), else
`num_nextn_predict_layers`, else 1 (Qwen3-Next-80B's config names neither and its checkpoint holds
one layer). Held where the checkpoint has `mtp.layers.0.*`: loaded into `model.mtp[0]`, the
checkpoint's `mtp.` renamed to `mtp.0.`. A config that declares more than one layer, or dedicated
embeddings, loads without MTP (the tensors ignored) and `method: "mtp"` is refused naming why
(`model.mtp_unavailable`): the published layout of those is not known here.

Hash: sha256 over every `mtp.*` tensor as stored (models/mtp.py's rule), `model.mtp_sha256`.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.linear import ReplicatedLinear
from metrale.layers.norm import ZeroCentredRMSNorm
from metrale.models.mtp import held_checkpoint_names, mark_drafter_only

CHECKPOINT_PREFIX = "mtp."


def declared_qwen_mtp_layers(config: ModelConfig) -> int:
    hf = config.hf_config
    for name in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = getattr(hf, name, None)
        if value is not None:
            return int(value)
    return 1


class QwenMTPLayer(nn.Module):
    """fc([pre_fc_norm_embedding(embed(next token)), pre_fc_norm_hidden(hidden)]) -> full-attention
    decoder layer -> norm (the module docstring). `block`: the decoder layer, kept as `layers[0]`
    for the checkpoint's names."""

    def __init__(self, config: ModelConfig, block: nn.Module):
        super().__init__()
        hidden, eps = config.hidden_size, config.hf_config.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(hidden, eps)
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([block])
        self.norm = ZeroCentredRMSNorm(hidden, eps)
        mark_drafter_only(block)

    @property
    def block(self) -> nn.Module:
        return self.layers[0]

    def cached_layers(self) -> list:
        return [m for m in self.block.modules() if hasattr(m, "cache_specs")]

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


def unavailable_reason(config: ModelConfig) -> str | None:
    """Why a checkpoint's `mtp.*` tensors are not loaded, or None where they are (if held)."""
    hf, declared = config.hf_config, declared_qwen_mtp_layers(config)
    if declared == 0:
        return "its config declares no MTP layers (mtp_num_hidden_layers 0)"
    if declared > 1:
        return (f"its config declares {declared} MTP layers; met drafts with the published one-layer layout only "
                "(mtp_num_hidden_layers 1)")
    if getattr(hf, "mtp_use_dedicated_embeddings", False):
        return ("its config sets mtp_use_dedicated_embeddings, a layout met has not seen published: the MTP layer's "
                "own embedding is not loaded")
    return None


def attach_qwen_mtp_layers(model: nn.Module, config: ModelConfig) -> None:
    """A Qwen family's __init__, after the trunk: `model.mtp` where the checkpoint holds
    `mtp.layers.0.*` and the layout is the published one; else the `mtp.*` tensors ignored (with
    `model.mtp_unavailable` saying why, for the drafter's refusal)."""
    model.mtp_sha256, model.mtp_tensor_count = None, 0
    model.mtp_checkpoint_prefixes = ()
    reason = unavailable_reason(config)
    held = any(name.startswith(CHECKPOINT_PREFIX + "layers.0.") for name in held_checkpoint_names())
    if reason is None and held:
        block = model.make_mtp_block(config, config.hf_config.num_hidden_layers)
        model.mtp = nn.ModuleList([QwenMTPLayer(config, block)])
        model.checkpoint_renames = type(model).checkpoint_renames + ((CHECKPOINT_PREFIX, "mtp.0."),)
        model.mtp_checkpoint_prefixes = (CHECKPOINT_PREFIX,)
        return
    model.ignored_checkpoint_prefixes = type(model).ignored_checkpoint_prefixes + (CHECKPOINT_PREFIX,)
    if reason is not None:
        model.mtp_unavailable = reason
