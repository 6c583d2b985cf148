"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`):

    images / videos -> Qwen2.5 vision tower (window attention, layers/vision/qwen2_5_tower.py)
                    -> one row of the text width per merged 2x2 patch block
    text            -> Qwen2 decoder (QKV bias) with contiguous M-RoPE (mrope_section, default
                       [16, 24, 24]); the vision rows replace the placeholder tokens' embeddings

Positions (`mrope_positions`): videos are spaced in time by tokens_per_second *
second_per_grid_ts (1 when the processor gives none). The shared VL parts (multimodal
embedding, forward, checkpoint names, tied embeddings) are in qwen_vl_base.py, the decoder and
M-RoPE set-up in qwen2_vl.py (this class is Qwen2-VL's with another tower and positions).
"""

from __future__ import annotations

import numpy as np

from metrale.layers.vision.qwen2_5_tower import Qwen2_5VisionTower
from metrale.models.qwen2_vl import Qwen2VLForConditionalGeneration
from metrale.models.qwen_vl_base import whole_config
from metrale.models.qwen_vl_positions import mrope_positions


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's model with the window-attention tower and time-spaced video positions."""

    vision_tower = Qwen2_5VisionTower

    @classmethod
    def mrope_positions(cls, hf_config, input_ids: list[int], image_grid_thw=None, video_grid_thw=None,
                        second_per_grid_ts=None, **video_kwargs) -> tuple[np.ndarray, int]:
        """transformers' get_rope_index for one sequence; `hf_config` the checkpoint's whole config."""
        if video_kwargs:
            raise ValueError(f"unknown video argument(s) {sorted(video_kwargs)} (Qwen2.5-VL takes second_per_grid_ts)")
        hf_config = whole_config(hf_config)
        vc = hf_config.vision_config
        intervals = None
        if video_grid_thw is not None and len(video_grid_thw):
            seconds = [1] * len(video_grid_thw) if second_per_grid_ts is None else [float(s) for s in second_per_grid_ts]
            # float32, as transformers multiplies the processor's float32 tensor (an int without one).
            intervals = [np.float32(vc.tokens_per_second) * np.float32(s) for s in seconds]
        return mrope_positions(input_ids, hf_config.image_token_id, hf_config.video_token_id, vc.spatial_merge_size,
                               image_grid_thw, video_grid_thw, intervals)
