"""What the scheduler tells the model runner about a request's media: plain ints, strings and
bytes, so a plan still crosses to the worker ranks as msgpack.

A `MediaItem` spans the request's tokens [offset, offset + length); the span's tokens that are
`placeholder_token_id` take the item's encoder output rows, in order. The runner computes an
item's encoder output the first time a step covers one of its placeholders and keeps it under
`content_hash` (executor/encoder_outputs.py), so requests with the same image share one run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MediaItem:
    modality: str  # "image" or "video"
    content_hash: str  # sha256 hex of the processed item (multimodal/inputs.py)
    offset: int
    length: int
    num_embeds: int  # placeholder tokens in the span: the rows of the item's encoder output
    placeholder_token_id: int
    pixel_values: bytes  # the processor's tensor, C order
    pixel_dtype: str  # numpy dtype name
    pixel_shape: list[int]
    grid_thw: list[int]  # [t, h, w] in patches
