"""The DeepSeek Sparse Attention (DSA) indexer in plain PyTorch: the ground truth of
`kernels/dsa_indexer.py`, one sequence at a time.

The indexer cache (docs/mla.md, "The indexer kernel") holds one key of index_head_dim values per
token, under the MLA block table:
  key_cache    [num_blocks, block_size, D]  model dtype, or float8_e4m3fn
  scale_cache  [num_blocks, block_size, 1]  float32, fp8 keys only: key ~= key_cache * scale
An fp8 key's scale is amax(|k|) / 448 (a zero key gets 1) and its values are k / scale rounded to
nearest-even onto e4m3.

For query row t at position p_t and each position s <= p_t of its sequence:
  score[t, s] = sum_h w[t, h] * relu(q[t, h, :] . k[s, :])      (float32)
with both of the indexer's scales already folded into w. The row selects the
min(index_topk, p_t + 1) positions of largest score, padded with -1 to index_topk columns.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_indexer_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [T, D] -> (float8_e4m3fn [T, D], float32 [T, 1]): one scale per token, amax / 448."""
    kf = k.float()
    amax = kf.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor: torch multiplies by the reciprocal of a Python scalar on CUDA, which is not
    # the correctly rounded amax / 448 the kernel computes.
    scale = amax / torch.full_like(amax, FP8_MAX)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return (kf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def write_indexer_keys(k: torch.Tensor, key_cache: torch.Tensor, scale_cache: torch.Tensor | None,
                       slot_mapping: torch.Tensor) -> None:
    """k [T, D] -> the caches at slot_mapping[t] (in place); slot -1 is padding, not written."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    if key_cache.dtype == FP8_DTYPE:
        assert scale_cache is not None, "fp8 indexer keys need their scale cache"
        values, scale = quantize_indexer_keys(k[keep])
        key_cache[blocks, offsets] = values
        scale_cache[blocks, offsets] = scale
    else:
        key_cache[blocks, offsets] = k[keep].to(key_cache.dtype)


def gather_keys(key_cache: torch.Tensor, scale_cache: torch.Tensor | None, block_table: torch.Tensor,
                seq_len: int) -> torch.Tensor:
    """One sequence's keys in position order, dequantized: float32 [seq_len, D]."""
    block_size = key_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    keys = key_cache[blocks].flatten(0, 1)[:seq_len].float()
    if key_cache.dtype == FP8_DTYPE:
        keys = keys * scale_cache[blocks].flatten(0, 1)[:seq_len].float()
    return keys


def indexer_scores(q: torch.Tensor, w: torch.Tensor, key_cache: torch.Tensor, scale_cache: torch.Tensor | None,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   max_context: int | None = None) -> torch.Tensor:
    """q [T, H, D], w [T, H] -> float32 [T, max_context]: the scores above, -inf past each row's
    position. max_context (>= every seq_len) defaults to the block table's capacity; rows after
    the last sequence's are all -inf (padding)."""
    seq_lens_cpu = seq_lens.tolist()
    starts = query_start_loc.tolist()
    width = block_tables.shape[1] * key_cache.shape[1] if max_context is None else max_context
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(seq_lens_cpu):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        keys = gather_keys(key_cache, scale_cache, block_tables[i], seq_len)
        logits = torch.einsum("thd,sd->ths", q[lo:hi].float(), keys).relu()
        scores = torch.einsum("ths,th->ts", logits, w[lo:hi].float())
        positions = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        out[lo:hi, :seq_len] = scores.masked_fill(~visible, float("-inf"))
    return out


def select_topk(scores: torch.Tensor, index_topk: int) -> torch.Tensor:
    """float32 [T, S] scores (-inf: not visible) -> int32 [T, index_topk]: the positions of each
    row's largest finite scores, -1 where a row has fewer than index_topk. Order within a row is
    by descending score; equal scores in any order."""
    k = min(index_topk, scores.shape[1])
    values, indices = scores.topk(k, dim=1) if k else (scores[:, :0], scores[:, :0].long())
    indices = torch.where(values == float("-inf"), -1, indices).to(torch.int32)
    pad = torch.full((scores.shape[0], index_topk - k), -1, dtype=torch.int32, device=scores.device)
    return torch.cat((indices, pad), dim=1)


def indexer_topk(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc, index_topk: int,
                 max_context: int | None = None) -> torch.Tensor:
    """The selection of each row: select_topk over indexer_scores."""
    scores = indexer_scores(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc, max_context)
    return select_topk(scores, index_topk)
