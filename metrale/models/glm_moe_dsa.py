"""GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3.2's model (models/deepseek_v32.py, inherited) with
two differences, as transformers' GlmMoeDsa*:

- the indexer's rope is interleaved (de-interleaved first, as the MLA's own);
- `indexer_types[i]` makes layer i "full" (it runs its indexer and keeps its indexer cache) or
  "shared" (no indexer, no indexer cache: its attention reuses the selection of the nearest full
  layer before it, made in the same step; layers/mla/layer.py says how it travels).

A config whose first layer is shared (no selection to reuse) or that names another indexer type
is refused by name. MTP (next-n) layers sit past indexer_types' end; each is built as a full
layer with its own indexer and loads as DeepSeek-V3's (models/mtp.py); not run.
"""

from __future__ import annotations

from metrale.config.model_config import ModelConfig
from metrale.models.deepseek_v32 import DeepseekV32ForCausalLM
from metrale.models.deepseek_v32 import unsupported_options as deepseek_v32_unsupported

FULL, SHARED = "full", "shared"


def indexer_types(config: ModelConfig) -> list[str]:
    """One per layer of the trunk: a config cut with --hf-overrides num_hidden_layers keeps its
    longer list, of which the first entries apply."""
    n = config.hf_config.num_hidden_layers
    types = getattr(config.hf_config, "indexer_types", None)
    return list(types)[:n] if types is not None else [FULL] * n


def unsupported_options(config: ModelConfig) -> list[str]:
    found = deepseek_v32_unsupported(config)
    types = indexer_types(config)
    unknown = sorted(set(types) - {FULL, SHARED})
    if unknown:
        found.append(f"indexer_types with {', '.join(map(repr, unknown))} (met runs 'full' and 'shared')")
    if types and types[0] == SHARED:
        found.append("indexer_types[0]='shared' (the first layer has no earlier selection to reuse)")
    if len(types) < config.hf_config.num_hidden_layers:
        found.append(f"indexer_types of {len(types)} entries for {config.hf_config.num_hidden_layers} layers")
    return found


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    indexer_rope_interleaved = True

    @staticmethod
    def unsupported_options(config: ModelConfig) -> list[str]:
        return unsupported_options(config)

    def selection_source(self, config: ModelConfig, layer_index: int) -> int | None:
        types = indexer_types(config)
        if layer_index >= len(types) or types[layer_index] == FULL:  # past the end: an MTP layer
            return None
        return max(i for i in range(layer_index) if types[i] == FULL)
