"""The DeepSeek Sparse Attention (DSA) indexer over the paged indexer cache, in Triton: the key
write (bf16 or per-token fp8), the scores and the top-k selection of every query row of a step.
What they compute is `dsa_indexer_reference.py` (the ground truth the tests compare against).

Layout (the indexer cache kind, docs/mla.md):
  key_cache     [num_blocks, block_size, D]  model dtype or float8_e4m3fn, contiguous
  scale_cache   [num_blocks, block_size, 1]  float32, fp8 keys only (or [num_blocks, block_size])
  block_tables  int32 [num_seqs, max_blocks]; position p of sequence i lives in block
                block_tables[i, p // block_size] at offset p % block_size
  seq_lens      int32 [num_seqs], the context INCLUDING the step's new tokens
  query_start_loc int32 [num_seqs + 1]: rows of sequence i are [i]..[i + 1], its last positions
Rows past query_start_loc[-1] (CUDA-graph padding) have no position: all -inf, all -1.

Kernels:
  * `_write_keys_kernel`: one program per token. fp8: scale = amax / 448 (1 for a zero key), both
    divisions correctly rounded and the value rounded onto e4m3's grid in float32 first
    (`round_to_e4m3`: Triton's own casts double-round), so the cache equals the reference's.
  * `_scores_kernel`: program (row, split of the context). It loads the row's H query heads
    once, then per tile of BLOCK_N keys one [H, D] x [D, BLOCK_N] dot, relu, and the w-weighted
    sum over heads: every key is read once per row, whatever H. An fp8 key's scale multiplies
    the tile's scores after the head sum (scale > 0, so relu(q . (s k)) = s relu(q . k)); its
    e4m3 values widen exactly to q's dtype. Tiles past the row's position are only filled with
    -inf, never read.
  * `_topk_kernel`: program per row, a radix select on the scores' ordered bit patterns: four
    histogram passes over the row's visible scores (8 bits each, from the top) find the k-th
    largest key exactly, then one pass writes the positions above it and, from those equal to
    it, the first ones by position until k are written. Rows with at most k visible positions
    copy 0..p and pad with -1. The selected positions come in no particular order (position
    order within the strictly-larger and the tied groups).

On sm_90 the scores kernel compiles to wgmma fed by a cp.async ring, and none of the three
spills (tests/kernels/compile_sm90.py compiles them without a GPU). Configs are untuned.
"""

from __future__ import annotations

import torch

from metrale.kernels import dsa_indexer_reference as reference
from metrale.kernels import interpret_mode, num_sms, tl, triton, use_triton
from metrale.kernels.fp8_quant import round_to_e4m3

FP8_DTYPE = torch.float8_e4m3fn


# --------------------------------------------------------------------------- key write


@triton.jit
def _write_keys_kernel(k_ptr, key_cache_ptr, scale_cache_ptr, slot_ptr, stride_kt, stride_cb, stride_co,
                       stride_sb, stride_so, block_size, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding
        return
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + d, mask=d_mask, other=0.0)
    dst = key_cache_ptr + block * stride_cb + offset * stride_co + d
    if FP8:
        kf = k.to(tl.float32)
        amax = tl.max(tl.abs(kf), axis=0)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))  # div_rn: `/` is approximate on GPUs
        scale = tl.where(amax == 0.0, 1.0, scale)
        v = round_to_e4m3(tl.clamp(tl.math.div_rn(kf, tl.full(kf.shape, 0.0, tl.float32) + scale), -448.0, 448.0))
        tl.store(dst, v.to(key_cache_ptr.dtype.element_ty), mask=d_mask)
        tl.store(scale_cache_ptr + block * stride_sb + offset * stride_so, scale)
    else:
        tl.store(dst, k.to(key_cache_ptr.dtype.element_ty), mask=d_mask)


def _check_cache(key_cache, scale_cache):
    assert key_cache.dim() == 3 and key_cache.is_contiguous(), "key_cache [num_blocks, block_size, D], contiguous"
    if key_cache.dtype == FP8_DTYPE:
        assert scale_cache is not None and scale_cache.dtype == torch.float32, "fp8 keys need a float32 scale cache"
        # [num_blocks, block_size, 1] as allocated, or that plane squeezed: the kernels read it
        # through its first two strides only.
        assert tuple(scale_cache.shape) in ((*key_cache.shape[:2], 1), tuple(key_cache.shape[:2])), scale_cache.shape


def write_indexer_keys_triton(k, key_cache, scale_cache, slot_mapping) -> None:
    """Triton path of write_indexer_keys (in place)."""
    _check_cache(key_cache, scale_cache)
    assert k.dim() == 2 and k.stride(-1) == 1 and k.shape[1] == key_cache.shape[2], k.shape
    if k.shape[0] == 0:
        return
    fp8 = key_cache.dtype == FP8_DTYPE
    scales = scale_cache if fp8 else key_cache  # unused without fp8
    _write_keys_kernel[(k.shape[0],)](
        k, key_cache, scales, slot_mapping, k.stride(0), key_cache.stride(0), key_cache.stride(1),
        scales.stride(0), scales.stride(1), key_cache.shape[1],
        HEAD_DIM=k.shape[1], BLOCK_D=triton.next_power_of_2(k.shape[1]), FP8=fp8)


def write_indexer_keys(k, key_cache, scale_cache, slot_mapping) -> None:
    """k [T, D] -> the indexer cache at slot_mapping[t] (in place; slot -1 skipped). fp8 keys get
    one float32 scale per token in scale_cache; bf16 keys are stored as they are."""
    if use_triton(k):
        write_indexer_keys_triton(k, key_cache, scale_cache, slot_mapping)
    else:
        reference.write_indexer_keys(k, key_cache, scale_cache, slot_mapping)


# --------------------------------------------------------------------------- scores


def row_positions(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_rows: int):
    """(int32 [num_rows] sequence of each row, int32 [num_rows] its position; -1 for rows past the
    last sequence's), on the device: no host sync."""
    rows = torch.arange(num_rows, device=seq_lens.device, dtype=torch.int32)
    num_seqs = seq_lens.shape[0]
    seq = torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True).clamp_(max=max(num_seqs - 1, 0))
    if num_seqs == 0:
        return seq.to(torch.int32), torch.full_like(rows, -1)
    pos = seq_lens[seq] - (query_start_loc[seq + 1] - rows)
    pos = torch.where(rows < query_start_loc[-1], pos, -1)
    return seq.to(torch.int32), pos.to(torch.int32)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # fp32-accumulating a @ b; UPCAST under the CPU interpreter for bf16, whose tl.dot multiplies
    # the raw storage (triton 3.9): the same products in fp32 (bf16 x bf16 products are exact).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit(do_not_specialize=["stride_bt", "max_context", "split_len"])  # vary by step
def _scores_kernel(
    q_ptr, w_ptr, key_cache_ptr, scale_cache_ptr, bt_ptr, row_seq_ptr, row_pos_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_cb, stride_co, stride_sb, stride_so, stride_bt, stride_ot,
    block_size, max_context, split_len,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # grid: (rows, splits). Program (t, j) writes out[t, j * split_len : (j + 1) * split_len].
    # Rows run last first: in a prefill chunk the later rows see the most keys, and starting them
    # first keeps the short ones for the tail.
    t = tl.num_programs(0) - 1 - tl.program_id(0)
    start = tl.program_id(1) * split_len
    end = tl.minimum(start + split_len, max_context)
    pos = tl.load(row_pos_ptr + t)
    seq = tl.load(row_seq_ptr + t)
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    # Keys start..scored_end-1 are visible; the rest of the split is -inf.
    scored_end = tl.minimum(end, pos + 1)
    fill_start = start + tl.cdiv(tl.maximum(scored_end - start, 0), BLOCK_N) * BLOCK_N
    if scored_end > start:
        h = tl.arange(0, BLOCK_H)
        h_valid = h < NUM_HEADS
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=h_valid[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + h, mask=h_valid, other=0.0)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for s in range(start, scored_end, BLOCK_N):
            n = s + tl.arange(0, BLOCK_N)
            valid = n < scored_end
            phys = tl.load(bt_row + n // block_size, mask=valid, other=0).to(tl.int64)
            offset = n % block_size
            k = tl.load(key_cache_ptr + (phys * stride_cb + offset * stride_co)[:, None] + d[None, :],
                        mask=valid[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
            logits = _dot(q, tl.trans(k), PRECISION, UPCAST)  # [BLOCK_H, BLOCK_N]
            score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
            if FP8:
                score *= tl.load(scale_cache_ptr + phys * stride_sb + offset * stride_so, mask=valid, other=0.0)
            tl.store(out_row + n, tl.where(valid, score, float("-inf")), mask=n < end)
    for s in range(fill_start, end, BLOCK_N):
        n = s + tl.arange(0, BLOCK_N)
        tl.store(out_row + n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=n < end)


SCORES_BLOCK_N = 64
MIN_SPLIT_KEYS = 128  # a split shorter than this spends more on loading q than on keys


def choose_num_splits(num_rows: int, max_context: int, device, block_n: int = SCORES_BLOCK_N) -> int:
    """About 4 waves of (row, split) programs over the SMs, no split under MIN_SPLIT_KEYS keys.
    Host-side only: never reads seq_lens."""
    want = triton.cdiv(4 * num_sms(device), max(1, num_rows))
    return max(1, min(want, triton.cdiv(max_context, max(MIN_SPLIT_KEYS, block_n))))


def _scores_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): untuned first choice (64-key tiles of 64 heads x 128)."""
    return (SCORES_BLOCK_N if head_dim <= 128 else SCORES_BLOCK_N // 2), 4, 2


def indexer_scores_triton(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc,
                          max_context: int | None = None, *, num_splits: int | None = None,
                          config: tuple | None = None, rows=None) -> torch.Tensor:
    """Triton path of indexer_scores. config: (BLOCK_N, num_warps, num_stages) instead of
    _scores_config's; rows: row_positions' pair when the caller already has it."""
    _check_cache(key_cache, scale_cache)
    assert q.dim() == 3 and q.stride(-1) == 1 and q.shape[2] == key_cache.shape[2], q.shape
    assert w.shape == q.shape[:2] and w.dtype == torch.float32 and w.stride(-1) == 1, (w.shape, w.dtype)
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    num_rows, num_heads, head_dim = q.shape
    block_size = key_cache.shape[1]
    if max_context is None:
        max_context = block_tables.shape[1] * block_size
    out = torch.empty((num_rows, max_context), dtype=torch.float32, device=q.device)
    if num_rows == 0 or max_context == 0:
        return out
    row_seq, row_pos = rows if rows is not None else row_positions(seq_lens, query_start_loc, num_rows)
    block_n, num_warps, num_stages = config or _scores_config(head_dim)
    splits = num_splits or choose_num_splits(num_rows, max_context, q.device, block_n)
    split_len = triton.cdiv(triton.cdiv(max_context, splits), block_n) * block_n
    splits = triton.cdiv(max_context, split_len)
    fp8 = key_cache.dtype == FP8_DTYPE
    scales = scale_cache if fp8 else key_cache  # unused without fp8
    _scores_kernel[(num_rows, splits)](
        q, w, key_cache, scales, block_tables, row_seq, row_pos, out,
        q.stride(0), q.stride(1), w.stride(0), key_cache.stride(0), key_cache.stride(1),
        scales.stride(0), scales.stride(1), block_tables.stride(0), out.stride(0),
        block_size, max_context, split_len,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n, FP8=fp8,
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        UPCAST=interpret_mode() and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages)
    return out


def indexer_scores(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc,
                   max_context: int | None = None) -> torch.Tensor:
    """q [T, H, D] roped indexer queries, w [T, H] float32 head weights (scales folded in) ->
    float32 [T, max_context]: sum_h w * relu(q . k[s]) for s <= the row's position, -inf beyond.
    max_context (a host int >= every seq_len) defaults to the block table's capacity."""
    if use_triton(q):
        return indexer_scores_triton(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc,
                                     max_context)
    return reference.indexer_scores(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc,
                                    max_context)


# --------------------------------------------------------------------------- top-k


@triton.jit
def _ordered_key(score):
    # float32 -> int64 in [0, 2^32) with the floats' order: negative floats flip their magnitude
    # bits (a larger magnitude is smaller), then the sign bit moves to the top.
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered.to(tl.int64) + 2147483648


@triton.jit(do_not_specialize=["stride_st", "stride_ot", "max_context", "index_topk"])
def _topk_kernel(scores_ptr, row_pos_ptr, out_ptr, stride_st, stride_ot, max_context, index_topk,
                 BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    n_visible = tl.minimum(tl.load(row_pos_ptr + t) + 1, max_context)  # <= 0 for a padding row
    row = scores_ptr + t.to(tl.int64) * stride_st
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    if n_visible <= index_topk:  # every visible position, then -1
        for s in range(0, index_topk, BLOCK_N):
            i = s + tl.arange(0, BLOCK_N)
            tl.store(out_row + i, tl.where(i < n_visible, i, -1), mask=i < index_topk)
    else:
        # Four 8-bit digits from the top. Invariant before each pass: `threshold` holds the
        # index_topk-th largest key's digits above `shift + 8`, and `need` is its rank among the
        # keys that share them. A pass histograms the next digit of those keys (the others go
        # to bin 511, never read: 512 bins, no mask argument, which older Triton lacks) and
        # keeps the largest digit whose bins from the top hold at least `need` keys.
        bins = tl.arange(0, 512)
        threshold = tl.zeros([], tl.int64)
        need = index_topk + tl.zeros([], tl.int32)
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            counts = tl.zeros([512], tl.int32)
            for s in range(0, n_visible, BLOCK_N):
                n = s + tl.arange(0, BLOCK_N)
                visible = n < n_visible
                key = _ordered_key(tl.load(row + n, mask=visible, other=0.0))
                same_prefix = visible & ((key >> (shift + 8)) == (threshold >> (shift + 8)))
                digit = tl.where(same_prefix, (key >> shift) & 255, 511).to(tl.int32)
                counts += tl.histogram(digit, 512)
            counts = tl.where(bins < 256, counts, 0)
            at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # keys with digit >= bin
            chosen = tl.max(tl.where((at_or_above >= need) & (bins < 256), bins, -1), axis=0)
            need -= tl.sum(tl.where(bins > chosen, counts, 0), axis=0)  # those ranked above the digit
            threshold = threshold | (chosen.to(tl.int64) << shift)
        num_above = index_topk - need  # keys strictly above the threshold; `need` ties complete the row
        # The num_above larger keys fill columns 0.., ties fill num_above.. up to index_topk.
        above_written = tl.zeros([], tl.int32)
        ties_written = tl.zeros([], tl.int32)
        for s in range(0, n_visible, BLOCK_N):
            n = s + tl.arange(0, BLOCK_N)
            visible = n < n_visible
            key = _ordered_key(tl.load(row + n, mask=visible, other=0.0))
            above = ((key > threshold) & visible).to(tl.int32)
            tie = ((key == threshold) & visible).to(tl.int32)
            above_rank = above_written + tl.cumsum(above, axis=0) - 1
            tie_col = num_above + ties_written + tl.cumsum(tie, axis=0) - 1
            tl.store(out_row + above_rank, n, mask=above > 0)
            tl.store(out_row + tie_col, n, mask=(tie > 0) & (tie_col < index_topk))
            above_written += tl.sum(above, axis=0)
            ties_written += tl.sum(tie, axis=0)


# Scores per tile of the select: each of its five passes walks a row's visible scores in dependent
# loads of this many, so a wide tile keeps a long row (16k contexts: 4 tiles a pass) from waiting
# on many small loads one after another; 8 warps hold it in 16 values a thread. Untuned.
TOPK_BLOCK_N = 4096


def select_topk_triton(scores: torch.Tensor, row_pos: torch.Tensor, index_topk: int, *,
                       block_n: int | None = None) -> torch.Tensor:
    """float32 [T, S] scores (visible: positions 0..row_pos[t]) -> int32 [T, index_topk].
    block_n: scores per tile (a power of two) instead of one sized from S (tests, benchmarks)."""
    assert scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(-1) == 1
    num_rows, max_context = scores.shape
    out = torch.empty((num_rows, index_topk), dtype=torch.int32, device=scores.device)
    if num_rows == 0 or index_topk == 0:
        return out
    block_n = block_n or max(256, min(TOPK_BLOCK_N, triton.next_power_of_2(max_context)))
    _topk_kernel[(num_rows,)](scores, row_pos, out, scores.stride(0), out.stride(0), max_context, index_topk,
                              BLOCK_N=block_n, num_warps=8 if block_n >= 2048 else 4)
    return out


def indexer_topk_triton(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc, index_topk: int,
                        max_context: int | None = None) -> torch.Tensor:
    rows = row_positions(seq_lens, query_start_loc, q.shape[0])
    scores = indexer_scores_triton(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc,
                                   max_context, rows=rows)
    return select_topk_triton(scores, rows[1], index_topk)


def indexer_topk(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc, index_topk: int,
                 max_context: int | None = None) -> torch.Tensor:
    """int32 [T, index_topk]: each row's min(index_topk, p + 1) positions of largest score (contract
    of docs/mla.md), -1 padded, in no particular order; ties at the k-th score broken by position
    in the kernel, arbitrarily in the reference."""
    if use_triton(q):
        return indexer_topk_triton(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc,
                                   index_topk, max_context)
    return reference.indexer_topk(q, w, key_cache, scale_cache, block_tables, seq_lens, query_start_loc,
                                  index_topk, max_context)
