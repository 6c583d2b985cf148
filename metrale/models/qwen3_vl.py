"""Qwen3-VL (`Qwen3VLForConditionalGeneration`):

    images / videos -> Qwen3 vision tower (layers/vision/qwen3_tower.py): per merged 2x2 block
                       the main row and one DeepStack row per `deepstack_visual_indexes` entry
                       (`embed_multimodal` returns them side by side: width hidden * (1 + k))
    text            -> Qwen3 decoder (per-head q/k RMSNorm) with interleaved M-RoPE
                       (mrope_section, default [24, 20, 20]); the main rows replace the
                       placeholder tokens' embeddings, DeepStack row i is added to the residual
                       stream after decoder layer i (i < k) at the same positions

Video: the processor writes each frame as its own run, "<{t:.1f} seconds>" text then
<|vision_start|> frame tokens <|vision_end|> (`frame_timestamps` gives t as transformers 5 does);
`mrope_positions` treats every frame as a grid of t = 1, so time reaches the model through that
text, not the position rows. The shared VL parts are in qwen_vl_base.py.
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.config.model_config import ModelConfig, ModelLoadError
from metrale.layers.vision.qwen3_tower import Qwen3VisionTower
from metrale.layers.mlp import GatedMLP
from metrale.models.qwen3 import Qwen3ForCausalLM
from metrale.models.qwen3_moe import Qwen3MoeSparseBlock, is_sparse_layer
from metrale.models.qwen_vl_base import QwenVLMixin, full_hf_config, use_mrope, whole_config
from metrale.models.qwen_vl_positions import mrope_positions


def frame_timestamps(frame_indices: list[int], fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch of a video sampled at `frame_indices` of a `fps` source: the
    mean of its first and last frame's time (the last frame repeated to fill the final patch)."""
    if fps <= 0:
        raise ValueError(f"video fps must be positive, not {fps}")
    indices = list(frame_indices)
    if not indices:
        raise ValueError("a video needs at least one frame")
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [i / fps for i in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


class Qwen3VLForConditionalGeneration(QwenVLMixin, Qwen3ForCausalLM):
    # Its prompts write each video frame's time as text (multimodal/timestamped_video.py).
    frame_timestamps = staticmethod(frame_timestamps)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        full = full_hf_config(config)
        vc = full.vision_config
        if vc.out_hidden_size != config.hidden_size:
            raise ModelLoadError(f"vision out_hidden_size {vc.out_hidden_size} != text hidden_size {config.hidden_size}")
        self.setup_vision(full, Qwen3VisionTower(vc), deepstack_layers=len(vc.deepstack_visual_indexes))

    def make_attention(self, config: ModelConfig, layer_index: int):
        return use_mrope(super().make_attention(config, layer_index), config, [24, 20, 20], interleaved=True)

    def tower_outputs(self, pixel_values, grid_thw):
        main, deepstack = self.visual(pixel_values, grid_thw)
        return torch.cat([main, *deepstack], dim=-1) if deepstack else main

    @classmethod
    def mrope_positions(cls, hf_config, input_ids: list[int], image_grid_thw=None, video_grid_thw=None,
                        **video_kwargs) -> tuple[np.ndarray, int]:
        """transformers' get_rope_index for one sequence; `hf_config` the checkpoint's whole config.
        Video timing is in the prompt's timestamp text: `second_per_grid_ts` changes nothing."""
        unknown = set(video_kwargs) - {"second_per_grid_ts"}
        if unknown:
            raise ValueError(f"unknown video argument(s) {sorted(unknown)} for Qwen3-VL")
        hf_config = whole_config(hf_config)
        return mrope_positions(input_ids, hf_config.image_token_id, hf_config.video_token_id,
                               hf_config.vision_config.spatial_merge_size, image_grid_thw, video_grid_thw,
                               frames_as_items=True)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: the same model with Qwen3-MoE's sparse blocks (softmax top-k, always
    renormalised, no shared expert) in the layers `is_sparse_layer` picks, on the shared FusedMoE."""

    def make_layer(self, config: ModelConfig, layer_index: int):
        hf = config.hf_config
        mlp = (Qwen3MoeSparseBlock(config, renormalize=True) if is_sparse_layer(hf, layer_index)
               else GatedMLP(config.hidden_size, hf.intermediate_size))
        return self.decoder_layer(config, self.make_attention(config, layer_index), mlp)
