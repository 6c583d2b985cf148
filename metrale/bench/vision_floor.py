"""The floor of a vision-language request: the vision tower's FLOPs, the text model's prefill
and decode FLOPs, and the weights read, over the rates `hardware.measure` found.

FLOPs count the matmuls only (2 per multiply-add): every linear layer on every row it sees and
attention's two products (QK^T and PV) over each attention segment, causal in the text model.
Norms, rotary and activations are left out, so the floor stays a lower bound. The tower's
segments come from the same grid arithmetic the tower uses (layers/vision/grid.py): a frame in
the full-attention blocks, a window in the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.bench.hardware import Floor, HardwareRates
from metrale.layers.vision.grid import frame_cu_seqlens, window_partition


def _segment_square_sum(cu_seqlens: torch.Tensor) -> int:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return sum(n * n for n in lengths)


def qwen2_5_vision_flops(vision_config, grids_thw: list[list[int]]) -> float:
    """Matmul FLOPs of Qwen2.5-VL's tower over the items `grids_thw` ([t, h, w] in patches each)."""
    for field in ("fullatt_block_indexes", "window_size", "depth", "intermediate_size"):
        if not hasattr(vision_config, field):
            raise ValueError(f"vision config has no {field}: not a Qwen2.5-VL vision tower")
    d, inner, depth = vision_config.hidden_size, vision_config.intermediate_size, vision_config.depth
    merge = vision_config.spatial_merge_size
    patch_width = vision_config.in_chans if hasattr(vision_config, "in_chans") else vision_config.in_channels
    patch_width *= vision_config.temporal_patch_size * vision_config.patch_size ** 2
    grid = torch.tensor(grids_thw, dtype=torch.int64).reshape(-1, 3)
    patches = int(grid.prod(dim=1).sum())
    full_blocks = len(set(vision_config.fullatt_block_indexes))
    window_units = vision_config.window_size // merge // vision_config.patch_size
    frame_squares = _segment_square_sum(frame_cu_seqlens(grid))
    window_squares = _segment_square_sum(window_partition(grid, merge, window_units)[1])
    # Per block: qkv (3 d^2) and proj (d^2); SwiGLU gate, up and down (3 d * inner).
    linear = patches * (patch_width * d + depth * (4 * d * d + 3 * d * inner))
    merged_width = d * merge * merge
    linear += patches // (merge * merge) * (merged_width * merged_width + merged_width * vision_config.out_hidden_size)
    attention = 2 * d * (full_blocks * frame_squares + (depth - full_blocks) * window_squares)
    return 2.0 * linear + 2.0 * attention


def _attention_width(text_config) -> int:
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return text_config.num_attention_heads * head_dim


def text_prefill_flops(text_config, active_params: int, prompt_lengths: list[int], lm_head_params: int = 0) -> float:
    """Every prompt token through the decoder's linear layers, the LM head on each prompt's last
    token only (`active_params` counts the head too); causal attention (L (L + 1) / 2 scores each)."""
    width, layers = _attention_width(text_config), text_config.num_hidden_layers
    scores = sum(n * (n + 1) // 2 for n in prompt_lengths)
    trunk = active_params - lm_head_params
    return (2.0 * trunk * sum(prompt_lengths) + 2.0 * lm_head_params * len(prompt_lengths)
            + 4.0 * layers * width * scores)


def text_decode_flops(text_config, active_params: int, prompt_lengths: list[int], output_len: int) -> float:
    """Tokens 2..output_len of each request (the first comes from the prefill), each over its context."""
    width, layers = _attention_width(text_config), text_config.num_hidden_layers
    tokens = len(prompt_lengths) * max(0, output_len - 1)
    scores = sum(n + t for n in prompt_lengths for t in range(1, output_len))
    return 2.0 * active_params * tokens + 4.0 * layers * width * scores


def kv_bytes_per_token(text_config, element_bytes: int = 2) -> int:
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return 2 * text_config.num_hidden_layers * text_config.num_key_value_heads * head_dim * element_bytes


@dataclass(frozen=True)
class VLWeights:
    """What a step reads and computes: the tower's parameters, and the text model's without the
    input embedding (only its rows are gathered) unless it is the LM head too; the LM head's
    share of the text parameters, which a prefill runs on one row per prompt."""

    vision_params: int
    vision_bytes: int
    text_params: int
    text_bytes: int
    lm_head_params: int = 0


def ttft_floor(weights: VLWeights, text_config, vision_config, grids_thw: list[list[int]], prompt_len: int,
               rates: HardwareRates) -> Floor:
    """One request: its images through the tower, its prompt through the text model, every
    weight read once."""
    flops = qwen2_5_vision_flops(vision_config, grids_thw) + text_prefill_flops(
        text_config, weights.text_params, [prompt_len], weights.lm_head_params)
    return Floor(weights.vision_bytes + weights.text_bytes, flops, rates)


def batch_floor(weights: VLWeights, text_config, vision_config, grids_thw: list[list[int]], prompt_lengths: list[int],
                output_len: int, rates: HardwareRates) -> Floor:
    """A batch run to `output_len` tokens each: every image through the tower, the prompts'
    prefill, and output_len - 1 decode steps that each read the text weights and every
    request's KV once; the tower's weights and the prefill's text weights once."""
    kv = kv_bytes_per_token(text_config)
    steps = max(0, output_len - 1)
    kv_reads = sum(n + t for n in prompt_lengths for t in range(1, output_len))
    moved = weights.vision_bytes + weights.text_bytes * (1 + steps) + kv * (sum(prompt_lengths) + kv_reads)
    flops = (qwen2_5_vision_flops(vision_config, grids_thw)
             + text_prefill_flops(text_config, weights.text_params, prompt_lengths, weights.lm_head_params)
             + text_decode_flops(text_config, weights.text_params, prompt_lengths, output_len))
    return Floor(moved, flops, rates)
