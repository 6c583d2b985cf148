"""A step's multimodal inputs, built by the model runner: the M-RoPE positions [3, T] of an
`uses_mrope` model and the MultiModalBatch of the placeholder rows the step computes.

Positions: a row at token index p of a request with media takes column p of the prompt's M-RoPE
positions while p is inside the prompt, p + delta after it (decode); a request without media
has p in all three rows. Placeholder rows: in each media span the step covers, the rows whose
token is the item's placeholder take the item's encoder output rows by their ordinal in the span,
so a chunk that splits an image takes the slice it covers. Encoder outputs come from the
runner's EncoderCache; the items it lacks run through `embed_multimodal` here, grouped by
modality, once per content hash.
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.layers.vision.batch import MultiModalBatch
from metrale.multimodal.encoder_cache import EncoderCache


def mrope_positions(scheduled, positions: np.ndarray, seq_index: np.ndarray) -> np.ndarray:
    """int64 [3, T] for the step's rows (`positions`: each row's token index)."""
    rows = np.broadcast_to(positions, (3, len(positions))).copy()
    for i, (_, state, _) in enumerate(scheduled):
        table = state.mrope_positions
        if table is None:
            continue
        mine = np.flatnonzero(seq_index == i)
        p = positions[mine]
        inside = p < table.shape[1]
        rows[:, mine[inside]] = table[:, p[inside]]
        rows[:, mine[~inside]] = p[~inside] + state.mrope_delta
    return rows


def _pixels(item) -> torch.Tensor:
    array = np.frombuffer(item.pixel_values, dtype=item.pixel_dtype).reshape(item.pixel_shape)
    return torch.from_numpy(array.copy())


def encode_missing(model, cache: EncoderCache, items: list, device: torch.device, dtype: torch.dtype) -> None:
    """Run the encoder for the items (MediaItem) whose output the cache lacks, one call per modality."""
    by_modality: dict[str, dict[str, object]] = {}
    for item in items:
        if item.content_hash not in cache:
            by_modality.setdefault(item.modality, {})[item.content_hash] = item
    for modality, todo in by_modality.items():
        pixels = torch.cat([_pixels(item) for item in todo.values()]).to(device=device, dtype=dtype)
        grid = torch.tensor([item.grid_thw for item in todo.values()], dtype=torch.int64, device=device)
        outputs = model.embed_multimodal(modality, pixels, grid)
        for (content_hash, item), output in zip(todo.items(), outputs):
            if output.shape[0] != item.num_embeds:
                raise RuntimeError(f"the encoder gave {output.shape[0]} rows for a {modality} of "
                                   f"{item.num_embeds} placeholder tokens")
            cache.put(content_hash, output)


def multimodal_batch(model, cache: EncoderCache, scheduled, starts: np.ndarray, query_lens: np.ndarray,
                     device: torch.device, dtype: torch.dtype) -> MultiModalBatch | None:
    """The step's placeholder rows and their encoder output rows, or None when it has none."""
    covered = []  # (row offset of the sequence in the step, state, item, first, last) token indices
    row = 0
    for (_, state, n), start in zip(scheduled, starts.tolist()):
        for item in state.media:
            first, last = max(start, item.offset), min(start + n, item.offset + item.length)
            if first < last:
                covered.append((row, state, item, first, last))
        row += n
    if not covered:
        return None
    encode_missing(model, cache, [c[2] for c in covered], device, dtype)
    is_mm = np.zeros(int(query_lens.sum()), dtype=bool)
    embeds = []
    for row, state, item, first, last in covered:
        span = np.asarray(state.token_ids[item.offset:item.offset + item.length]) == item.placeholder_token_id
        ordinal = np.cumsum(span) - 1
        local = np.arange(first, last)
        take = span[local - item.offset]
        if not take.any():
            continue
        start = int(state.num_computed_tokens)
        is_mm[row + local[take] - start] = True
        embeds.append(cache.get(item.content_hash)[torch.from_numpy(ordinal[local[take] - item.offset])
                                                   .to(device)])
    if not embeds:
        return None
    return MultiModalBatch(torch.cat(embeds), torch.from_numpy(is_mm).to(device))
