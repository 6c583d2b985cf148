"""Qwen2-VL (`Qwen2VLForConditionalGeneration`): the Qwen2-VL vision tower
(layers/vision/qwen2_tower.py: LayerNorm blocks, full attention per frame) in front of the Qwen2
decoder with contiguous M-RoPE, as Qwen2.5-VL (qwen2_5_vl.py) but without window attention and
with a video's time index stepping by one per temporal patch."""

from __future__ import annotations

import numpy as np

from metrale.config.model_config import ModelConfig
from metrale.layers.vision.qwen2_tower import Qwen2VisionTower
from metrale.models.llama import Qwen2ForCausalLM
from metrale.models.qwen_vl_base import QwenVLMixin, full_hf_config, use_mrope, whole_config
from metrale.models.qwen_vl_positions import mrope_positions


class Qwen2VLForConditionalGeneration(QwenVLMixin, Qwen2ForCausalLM):
    """Also the base of Qwen2.5-VL, which changes the tower (`vision_tower`) and the positions."""

    vision_tower = Qwen2VisionTower

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        full = full_hf_config(config)
        self.setup_vision(full, self.vision_tower(full.vision_config), deepstack_layers=0)

    def make_attention(self, config: ModelConfig, layer_index: int):
        return use_mrope(super().make_attention(config, layer_index), config, [16, 24, 24], interleaved=False)

    def tower_outputs(self, pixel_values, grid_thw):
        return self.visual(pixel_values, grid_thw)

    @classmethod
    def mrope_positions(cls, hf_config, input_ids: list[int], image_grid_thw=None, video_grid_thw=None,
                        **video_kwargs) -> tuple[np.ndarray, int]:
        """transformers' get_rope_index for one sequence; `hf_config` the checkpoint's whole config."""
        if video_kwargs:
            raise ValueError(f"unknown video argument(s) {sorted(video_kwargs)} for Qwen2-VL")
        hf_config = whole_config(hf_config)
        return mrope_positions(input_ids, hf_config.image_token_id, hf_config.video_token_id,
                               hf_config.vision_config.spatial_merge_size, image_grid_thw, video_grid_thw)
