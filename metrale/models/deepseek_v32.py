"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3 with DeepSeek Sparse Attention. Every
layer's MLA runs a lightning indexer (layers/mla/indexer.py) that picks, per query row, the
index_topk context positions its attention sees; the rest of the model is DeepSeek-V3's trunk
(models/deepseek_v3.py), inherited, not copied:

    layer i:  RMSNorm -> MLAAttention + DSAIndexer (sparse over the indexer's selection) -> residual
              RMSNorm -> GatedMLP (i < first_k_dense_replace) or DeepSeek-V3's MoE block -> residual

As transformers' DeepseekV32Attention: the MLA rope is always interleaved (the config has no
rope_interleave), the indexer's is half-split; the query is always low-rank (q_a_proj,
q_a_layernorm, q_b_proj: the indexer reads q_a_layernorm's output), so a config without a
q_lora_rank is refused. The indexer's checkpoint names are transformers' (`self_attn.indexer.
wq_b`, `.wk`, `.k_norm`, `.weights_proj`).

Caches: each layer keeps its latent (kind "mla") and its indexer keys (kind "indexer",
`--indexer-cache-dtype`: the model dtype, bfloat16, or fp8 keys with a float32 scale per token).
MTP (next-n) layers load as DeepSeek-V3's (models/mtp.py), each built as a full layer with its
own indexer; not run.

Options met does not run are refused by name: DeepSeek-V3's, plus a q_lora_rank of None, a
rope_interleave other than true, an
mlp_layer_types that is not `first_k_dense_replace` dense layers then MoE, and an index_head_dim
smaller than qk_rope_head_dim.
"""

from __future__ import annotations

from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.mla import MLAAttention
from metrale.layers.mla.indexer import DSAIndexer, IndexerDims
from metrale.models.deepseek_v3 import DeepseekV3ForCausalLM, make_mla
from metrale.models.deepseek_v3 import unsupported_options as deepseek_v3_unsupported


def unsupported_options(config: ModelConfig) -> list[str]:
    hf = config.hf_config
    found = deepseek_v3_unsupported(hf)
    if getattr(hf, "rope_interleave", True) is not True:  # make_mla reads it; the reference ignores it
        found.append(f"rope_interleave={hf.rope_interleave!r} (the MLA rope here is always interleaved)")
    if hf.q_lora_rank is None:
        found.append("q_lora_rank=None (the DSA indexer reads the low-rank query)")
    dense = min(hf.first_k_dense_replace or 0, hf.num_hidden_layers)
    standard = ["dense"] * dense + ["sparse"] * (hf.num_hidden_layers - dense)
    # The first num_hidden_layers entries: a config cut with --hf-overrides keeps its longer list.
    mlp_types = getattr(hf, "mlp_layer_types", None)
    if mlp_types is not None and list(mlp_types)[:hf.num_hidden_layers] != standard:
        found.append(f"mlp_layer_types={list(mlp_types)!r} (met runs first_k_dense_replace dense layers, then MoE)")
    if hf.index_head_dim < hf.qk_rope_head_dim:
        found.append(f"index_head_dim={hf.index_head_dim} (below qk_rope_head_dim={hf.qk_rope_head_dim})")
    return found


def make_indexer(config: ModelConfig, rope_interleaved: bool) -> DSAIndexer:
    hf = config.hf_config
    dims = IndexerDims(config.hidden_size, hf.q_lora_rank, hf.index_n_heads, hf.index_head_dim,
                       hf.qk_rope_head_dim, hf.index_topk)
    return DSAIndexer(dims, rope_interleaved)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    # The indexer's rope: half-split here, interleaved on GLM-5.
    indexer_rope_interleaved = False

    @staticmethod
    def unsupported_options(config: ModelConfig) -> list[str]:
        return unsupported_options(config)

    def make_mixer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return self.make_dsa_mla(config, layer_index, self.selection_source(config, layer_index))

    def selection_source(self, config: ModelConfig, layer_index: int) -> int | None:
        """The earlier layer whose selection this one reuses, or None: it runs its own indexer."""
        return None

    def make_dsa_mla(self, config: ModelConfig, layer_index: int, selection_source: int | None) -> MLAAttention:
        if selection_source is not None:
            return make_mla(config, layer_index, selection_source=selection_source)
        return make_mla(config, layer_index, indexer=make_indexer(config, self.indexer_rope_interleaved))
