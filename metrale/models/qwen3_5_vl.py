"""Qwen3.5's vision-language models (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`):

    images / videos -> Qwen3-VL's vision tower without DeepStack (layers/vision/qwen3_tower.py)
    text            -> the Qwen3.5 hybrid text model (models/qwen3_5.py: Gated DeltaNet layers
                       and gated attention), its attention layers' partial RoPE made interleaved
                       M-RoPE (mrope_section over the rotary part, default [11, 11, 10]); the
                       Gated DeltaNet layers take no positions

Prompts, positions and video frames are Qwen3-VL's (`mrope_positions`: every frame its own run).
The MTP layer of the checkpoints loads as the text model's and keeps plain RoPE: drafting with
it is for text; multimodal prompts with MTP drafts are not tested.
"""

from __future__ import annotations

from metrale.config.model_config import ModelConfig, ModelLoadError
from metrale.layers.vision.qwen3_tower import Qwen3VisionTower
from metrale.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from metrale.models.qwen3_vl import Qwen3VLForConditionalGeneration
from metrale.models.qwen_vl_base import QwenVLMixin, full_hf_config, use_mrope


class Qwen3_5ForConditionalGeneration(QwenVLMixin, Qwen3_5ForCausalLM):
    # The text model skips the tower's tensors; here they load (renamed to visual.* first).
    ignored_checkpoint_prefixes = tuple(p for p in Qwen3_5ForCausalLM.ignored_checkpoint_prefixes
                                        if p != "model.visual.")
    mrope_positions = Qwen3VLForConditionalGeneration.mrope_positions
    frame_timestamps = Qwen3VLForConditionalGeneration.frame_timestamps

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        full = full_hf_config(config)
        vc = full.vision_config
        if vc.out_hidden_size != config.hidden_size:
            raise ModelLoadError(f"vision out_hidden_size {vc.out_hidden_size} != text hidden_size {config.hidden_size}")
        self.setup_vision(full, Qwen3VisionTower(vc), deepstack_layers=0)

    def make_layer(self, config: ModelConfig, layer_index: int):
        layer = super().make_layer(config, layer_index)
        if layer.mixer_name == "self_attn":
            use_mrope(layer.self_attn, config, [11, 11, 10], interleaved=True)
        return layer

    def tower_outputs(self, pixel_values, grid_thw):
        main, _ = self.visual(pixel_values, grid_thw)
        return main


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    mlp = Qwen3_5MoeForCausalLM.mlp
