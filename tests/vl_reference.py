"""Helpers of the vision-language model tests: prompts with vision placeholders, transformers'
greedy continuation of them, and a stand-in for the engine's multimodal plumbing that lets the
text engine run one multimodal request (test-only; the real path is metrale/multimodal/).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoImageProcessor, AutoTokenizer

from vl_checkpoints import tiny_images, tiny_video, video_pixel_values


class Media:
    """A checkpoint's processed test media: two images and one video of t = 2 temporal patches."""

    def __init__(self, path: str):
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.ids = {t: self.tokenizer.convert_tokens_to_ids(t)
                    for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
        processor = AutoImageProcessor.from_pretrained(path)
        self.merge = processor.merge_size
        images = processor(images=tiny_images(), return_tensors="pt")
        self.image_pixels, self.image_grid = images["pixel_values"], images["image_grid_thw"]
        self.video_pixels, self.video_grid = video_pixel_values(processor, tiny_video())

    def tokens(self, grid) -> int:
        t, h, w = (int(v) for v in grid)
        return t * h * w // self.merge ** 2

    def placeholder(self, kind: str, grid, frames_as_items: bool = False) -> list[int]:
        start, end, pad = self.ids["<|vision_start|>"], self.ids["<|vision_end|>"], self.ids[f"<|{kind}_pad|>"]
        if not frames_as_items:
            return [start] + [pad] * self.tokens(grid) + [end]
        t, h, w = (int(v) for v in grid)
        per_frame = self.tokens((1, h, w))
        # Qwen3-VL's processor: "<t seconds>" text before each frame (any text tokens do here).
        return [tok for i in range(t) for tok in [11 + i, 12, start] + [pad] * per_frame + [end]]

    def token_types(self, ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([ids])
        return ((ids == self.ids["<|image_pad|>"]).int() + 2 * (ids == self.ids["<|video_pad|>"]).int())


@torch.no_grad()
def reference_greedy_vl(model, ids: list[int], new_tokens: int, **vision) -> list[int]:
    model.model.rope_deltas = None
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **vision)
    # transformers keeps the request's position delta on the model, for later text-only calls too.
    model.model.rope_deltas = None
    return out[0, len(ids):].tolist()


def drive_multimodal(model, prompt: list[int], positions: np.ndarray, delta: int, embeds: torch.Tensor,
                     placeholder_ids: set[int]):
    """Make the engine's model take one request's M-RoPE positions and vision rows: the runner
    passes token indices [T]; index p < len(prompt) becomes positions[:, p], later ones p + delta,
    and placeholder tokens take their rows of `embeds` (by their ordinal among placeholders)."""
    from metrale.layers.vision.batch import MultiModalBatch

    forward = type(model).forward
    is_placeholder = np.isin(np.asarray(prompt), list(placeholder_ids))
    ordinal = np.cumsum(is_placeholder) - 1
    table = torch.from_numpy(positions)

    def wrapped(input_ids, index, multimodal=None):
        if index.dim() == 2:  # the runner's [3, T] for an M-RoPE model: equal rows for a prompt without media
            index = index[0]
        idx = index.cpu().numpy()
        in_prompt = idx < len(prompt)
        rows = torch.empty(3, len(idx), dtype=torch.int64)
        rows[:, torch.from_numpy(in_prompt)] = table[:, idx[in_prompt]]
        rows[:, torch.from_numpy(~in_prompt)] = torch.from_numpy(idx[~in_prompt] + delta)
        mask = np.zeros(len(idx), dtype=bool)
        mask[in_prompt] = is_placeholder[idx[in_prompt]]
        batch = None
        if mask.any():
            batch = MultiModalBatch(embeds[torch.from_numpy(ordinal[idx[mask]])], torch.from_numpy(mask))
        return forward(model, input_ids, rows.to(input_ids.device), batch)

    model.forward = wrapped
