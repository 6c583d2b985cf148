"""A prompt's media after processing: one `MultiModalItem` per image or video, and the request's
`MultiModalInputs` (the expanded token ids, the items in prompt order, the M-RoPE positions).

Invariants: items are in the order of their placeholders in `token_ids`, their spans do not
overlap, and item i's placeholder tokens inside its span number exactly its encoder output's rows
(`num_embeds`). `content_hash` is the sha256 of the processed pixels' bytes, their shape and
dtype, the grid and the modality: two items with one hash give the same encoder output, so the
encoder cache and the prefix cache may share it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from metrale.messages.multimodal import MediaItem


def content_hash(modality: str, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> str:
    h = hashlib.sha256()
    h.update(modality.encode())
    h.update(str(pixel_values.dtype).encode())
    h.update(np.asarray(pixel_values.shape, dtype=np.int64).tobytes())
    h.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixel_values).tobytes())
    return h.hexdigest()


@dataclass
class MultiModalItem:
    modality: str  # "image" or "video"
    pixel_values: np.ndarray  # float32 [patches, C * T * P * P], as the HF processor lays them out
    grid_thw: tuple[int, int, int]
    offset: int  # the span's first token in the prompt
    length: int  # the span's tokens
    num_embeds: int  # placeholder tokens in the span = encoder output rows
    placeholder_token_id: int
    second_per_grid_t: float | None = None  # videos: seconds per temporal patch
    content_hash: str = ""

    def __post_init__(self) -> None:
        if not self.content_hash:
            self.content_hash = content_hash(self.modality, self.pixel_values, self.grid_thw)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_message(self) -> MediaItem:
        """The runner's copy: plain bytes, so the plan still crosses processes as msgpack."""
        pixels = np.ascontiguousarray(self.pixel_values)
        return MediaItem(self.modality, self.content_hash, self.offset, self.length, self.num_embeds,
                         self.placeholder_token_id, pixels.tobytes(), str(pixels.dtype), list(pixels.shape),
                         list(self.grid_thw))


@dataclass
class MultiModalInputs:
    token_ids: list[int]  # the prompt with each placeholder expanded to its item's tokens
    items: list[MultiModalItem] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None  # int64 [3, len(token_ids)]
    mrope_delta: int = 0  # a token at index i >= len(token_ids) has position i + delta in all rows

    @property
    def encoder_tokens(self) -> int:
        return sum(item.num_embeds for item in self.items)
