"""GLM-5.3 (`Glm5NextForCausalLM`; the text part of `Glm5NextForConditionalGeneration`): a hybrid
of Kimi Delta Attention and DSA multi-head latent attention, with hyper-connection residual
streams. As transformers' Glm5NextTextModel:

    streams   = hc_mult copies of embed_tokens(ids)                            [T, N, D]
    layer i:  x = attn_hc.collapse(streams) -> RMSNorm -> token mixer -> attn_hc.expand
              x = ffn_hc.collapse(streams)  -> RMSNorm -> MLP         -> ffn_hc.expand
    out       = RMSNorm(mean of the streams) -> lm_head
    mixer:    KimiDeltaAttention (layers/linear_attention/kda.py) where layer_types[i] is
              "linear_attention"; else ("indexed_attention") MLA without RoPE
              (qk_rope_head_dim 0: the latent alone is cached) whose DSA indexer scores pooled
              index groups (index_kpool, layers/mla/indexer_pooling.py). indexer_types[i] "full"
              runs the layer's indexer; "shared" reuses the selection of the nearest earlier full
              indexed layer, made in the same step (transformers passes a selection only from the
              layer directly before, and raises where that is not a full indexed layer; the
              layouts it runs are the ones tested).
    MLP:      mlp_layer_types[i] "dense": SwiGLU of intermediate_size; "sparse": DeepSeek-V3's
              MoE block (sigmoid routing with correction bias, groups, routed_scaling_factor,
              shared experts); every gate and up clamped by swiglu_limit.
    The hyper-connections: layers/hyper_connection.py.

The latent norms use rms_norm_eps (unlike DeepSeek-V3's fixed 1e-6); the MLA softmax scale is
qk_head_dim ** -0.5.

Checkpoints: the text weights under `model.language_model.` (the multimodal checkpoint) or
`model.` (a text-only one), GLM's own names (hc_attn_fn / hc_attn_base / hc_attn_scale and the
ffn ones, the KDA forget gate's f_a_proj, f_b_proj, dt_bias, A_log beside the other
projections, q/k/v_conv1d apart, experts per expert), renamed onto ours; transformers'
in-memory names load too. `model.visual.*` (the vision tower) is skipped: met serves the text
part, and a request with an image is refused by the server as for any text model. The MTP
(next-n) layers past the trunk (`model.layers.{num_hidden_layers}.*`, transformers ignores them
too) are skipped, not loaded or hashed: their layout under the hyper-connection streams (which
streams the layer reads, whether it has its own hc mixing) is published nowhere met could check,
so `method: "mtp"` is refused by name (`mtp_unavailable`) rather than guessed.

Caches: the KDA layers a state slot each ("kda"), the MLA layers their latent ("mla"), the full
indexed layers their pooled indexer keys and gate logits ("pooled_indexer"); all paged ones
under one block table. Options met does not run are refused by name (`unsupported_options`).
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig, ModelLoadError
from metrale.layers.hyper_connection import HyperConnection, HyperConnectionDims
from metrale.layers.linear_attention.kda import CONV_STACKED_PARAMS, KDADims, KimiDeltaAttention
from metrale.layers.linear_attention.kda import STACKED_PARAMS as KDA_STACKED_PARAMS
from metrale.layers.mla import MLAAttention, MLADims
from metrale.layers.mla.indexer import POOLED_KIND, DSAIndexer, IndexerDims
from metrale.layers.mla.indexer_pooling import IndexerPooling
from metrale.layers.mlp import GatedMLP
from metrale.layers.norm import RMSNorm
from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from metrale.models.deepseek_v3 import DeepseekV3MoE

LINEAR, INDEXED = "linear_attention", "indexed_attention"
FULL, SHARED = "full", "shared"


def _per_layer(hf, name: str) -> list:
    """The first num_hidden_layers entries of a per-layer list (a config cut with --hf-overrides
    keeps its longer list)."""
    return list(getattr(hf, name, None) or [])[:hf.num_hidden_layers]


def unsupported_options(hf) -> list[str]:
    """The config's options this implementation would run wrong, each named."""
    found, n = [], hf.num_hidden_layers
    for name, supported in (("hidden_act", "silu"), ("attention_bias", False), ("qk_rope_head_dim", 0)):
        if getattr(hf, name, supported) != supported:
            found.append(f"{name}={getattr(hf, name)!r} (met runs {supported!r})")
    if hf.q_lora_rank is None:
        found.append("q_lora_rank=None (the DSA indexer reads the low-rank query)")
    if getattr(hf, "num_key_value_heads", hf.num_attention_heads) != hf.num_attention_heads:
        found.append(f"num_key_value_heads={hf.num_key_value_heads} (MLA: one per attention head)")
    for name, allowed in (("layer_types", {LINEAR, INDEXED}), ("indexer_types", {FULL, SHARED}),
                          ("mlp_layer_types", {"dense", "sparse"})):
        types = _per_layer(hf, name)
        if len(types) < n:
            found.append(f"{name} of {len(types)} entries for {n} layers")
        unknown = sorted(set(types) - allowed)
        if unknown:
            found.append(f"{name} with {', '.join(map(repr, unknown))} (met runs {', '.join(sorted(allowed))})")
    if not found:
        first = next((i for i in range(n) if hf.layer_types[i] == INDEXED), None)
        if first is not None and hf.indexer_types[first] == SHARED:
            found.append(f"indexer_types[{first}]='shared' (the first indexed layer has no selection to reuse)")
    return found


def selection_source(hf, layer_index: int) -> int | None:
    """The full indexed layer whose selection a shared one reuses, or None: it runs its own."""
    if hf.indexer_types[layer_index] == FULL:
        return None
    return max(i for i in range(layer_index) if hf.layer_types[i] == INDEXED and hf.indexer_types[i] == FULL)


def make_indexed_attention(config: ModelConfig, layer_index: int) -> MLAAttention:
    hf = config.hf_config
    dims = MLADims(config.hidden_size, hf.num_attention_heads, hf.q_lora_rank, hf.kv_lora_rank,
                   hf.qk_nope_head_dim, 0, hf.v_head_dim)
    scale = dims.qk_head_dim ** -0.5
    source = selection_source(hf, layer_index)
    if source is not None:
        return MLAAttention(dims, layer_index, None, scale, hf.rms_norm_eps, selection_source=source,
                            selection_kind=POOLED_KIND)
    indexer = DSAIndexer(IndexerDims(config.hidden_size, hf.q_lora_rank, hf.index_n_heads, hf.index_head_dim, 0,
                                     hf.index_topk), rope_interleaved=False,
                         pooling=IndexerPooling(hf.index_kpool, bool(hf.index_kpool_always_select_tail)))
    return MLAAttention(dims, layer_index, None, scale, hf.rms_norm_eps, indexer=indexer)


def make_mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    hf = config.hf_config
    if hf.mlp_layer_types[layer_index] == "dense":
        return GatedMLP(config.hidden_size, hf.intermediate_size, swiglu_limit=hf.swiglu_limit)
    return DeepseekV3MoE(config, swiglu_limit=hf.swiglu_limit)


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        hf = config.hf_config
        self.self_attn = (KimiDeltaAttention(KDADims.of(hf), layer_index) if hf.layer_types[layer_index] == LINEAR
                          else make_indexed_attention(config, layer_index))
        self.mlp = make_mlp(config, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        hc = HyperConnectionDims.of(hf)
        self.attn_hc, self.ffn_hc = HyperConnection(hc), HyperConnection(hc)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, hc_mult, hidden] -> the same."""
        x, mixing = self.attn_hc.collapse(streams)
        streams = HyperConnection.expand(self.self_attn(positions, self.input_layernorm(x)), streams, mixing)
        x, mixing = self.ffn_hc.collapse(streams)
        return HyperConnection.expand(self.mlp(self.post_attention_layernorm(x)), streams, mixing)


class Glm5NextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hf = config.hf_config
        self.streams = hf.hc_mult
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams)
        return self.norm(streams.mean(dim=1))


class Glm5NextForCausalLM(nn.Module):
    stacked_params = [*KDA_STACKED_PARAMS, *CONV_STACKED_PARAMS,
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    checkpoint_renames = (
        ("model.language_model.", "model."),
        *((f".hc_{site}_{part}", f".{site}_hc.{part}") for site in ("attn", "ffn") for part in ("fn", "base", "scale")),
        *((f".self_attn.{name}", f".self_attn.forget_gate.{name}") for name in ("f_a_proj.", "f_b_proj.", "dt_bias",
                                                                              "A_log")),
        (".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"),
    )

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf = config.hf_config
        unsupported = unsupported_options(hf)
        if unsupported:
            raise ModelLoadError(f"{config.architecture}: config options met does not implement: "
                                 f"{', '.join(unsupported)}")
        self.config = config
        mtp_layers = getattr(hf, "num_nextn_predict_layers", None) or 1
        self.ignored_checkpoint_prefixes = ("model.visual.", *(f"model.layers.{hf.num_hidden_layers + i}."
                                                               for i in range(mtp_layers)))
        self.mtp_unavailable = ("GLM-5.3's next-n layer layout (model.layers.{N}.* under hyper-connection streams) "
                                "is not published in a form met could verify, so it is not loaded")
        self.model = Glm5NextModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(hf, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def dummy_reference(hf_config) -> dict[str, torch.Tensor]:
        """The checkpoint names and shapes `--load-format dummy` draws (loader/weights.py): those
        of transformers' multimodal wrapper around this text config (it has no causal-LM class for
        it; a one-block vision tower, which the loader skips), with the KDA conv weight split back
        into q/k/v_conv1d as the checkpoints store it."""
        from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=hf_config.hidden_size)
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=hf_config.to_dict(), vision_config=vision))
        shapes = {}
        for name, tensor in model.state_dict().items():
            if not name.endswith(".self_attn.conv1d.weight"):
                shapes[name] = tensor
                continue
            for part, piece in zip("qkv", tensor.chunk(3)):
                shapes[name.replace(".conv1d.", f".{part}_conv1d.")] = piece
        return shapes

    @property
    def tied_embeddings(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
