"""Qwen3.5 (dense and MoE), the text models: Qwen3-Next's hybrid of Gated DeltaNet and gated
attention, with the linear-attention input projections stored apart (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a) instead of interleaved per key head.

- Qwen3_5ForCausalLM: a dense SwiGLU MLP in every layer.
- Qwen3_5MoeForCausalLM: a sparse MoE block in every layer (softmax top-k, always
  renormalised) with a sigmoid-gated shared expert.
The M-RoPE of the vision models reduces to Qwen3-Next's partial RoPE for text, whose three
position rows are equal. Checkpoints may carry `mtp.*` (the MTP layer, loaded as Qwen3-Next's:
models/qwen_mtp.py) and `model.visual.*` (the vision tower of the multimodal checkpoints, not
loaded by the text model).
"""

from __future__ import annotations

from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.mlp import GatedMLP
from metrale.models.common import CausalLM
from metrale.models.qwen3_moe import Qwen3MoeSparseBlock
from metrale.models.qwen3_next import Qwen3NextForCausalLM, token_mixer

class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    stacked_params = CausalLM.stacked_params + [
        ("in_proj", "in_proj_qkv", (0, 1, 2)), ("in_proj", "in_proj_z", 3), ("in_proj", "in_proj_b", 4),
        ("in_proj", "in_proj_a", 5)]
    ignored_checkpoint_prefixes = ("model.visual.",)

    def mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.hf_config.intermediate_size)

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        mixer, name = token_mixer(config, layer_index)
        return self.decoder_layer(config, mixer, self.mlp(config, layer_index), name)

    def mtp_mlp(self, config: ModelConfig) -> nn.Module:
        return self.mlp(config, 0)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return Qwen3MoeSparseBlock(config, renormalize=True)
