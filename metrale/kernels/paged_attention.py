"""Attention over the paged KV cache: extend/prefill (causal, ragged) and split-KV decode.

Layout (see docs/kernels.md):
  k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  block_tables      int32 [num_seqs, max_blocks]; position n of sequence i lives in
                    block block_tables[i, n // block_size] at offset n % block_size
  seq_lens          int32 [num_seqs]: context length INCLUDING the new tokens
  cu_seqlens_q      int32 [num_seqs + 1]: query rows of sequence i are cu[i]..cu[i+1]
Query token j of sequence i is at position seq_lens[i] - q_len_i + j and sees
positions 0..that position. Head h reads kv head h // (num_heads // num_kv_heads).

Both kernels tile the rows of one KV-head group together (GQA): every K/V tile
is loaded once and used by all query heads that share it. Softmax is online
(flash-attention style) in fp32 with exp2; P is cast to the KV dtype for P @ V.
Block-table entries past a sequence's length are never read.
"""

from __future__ import annotations

import torch

from metrale.kernels import (interpret_mode, num_sms, pdl_args, pdl_launch_dependents, pdl_wait, reference, tl,
                             triton, use_triton)

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # fp32-accumulating a @ b. UPCAST is only set under the Triton CPU interpreter for
    # bf16, whose tl.dot multiplies the raw uint16 storage (triton 3.9): the same products
    # computed in fp32 instead (bf16 x bf16 products are exact in fp32).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr,
    start, kv_end, q_pos, kvh, block_size, d, d_mask,
    stride_cb, stride_co, stride_ch, scale_log2e,
    MASK_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One online-softmax step over keys start..start+BLOCK_N-1 (those >= kv_end are masked).

    Invariant: after the first call every row has seen at least one unmasked key,
    so m_i is finite and no NaN can appear (exp2(-inf - finite) = 0).
    """
    n = start + tl.arange(0, BLOCK_N)
    n_valid = n < kv_end
    phys = tl.load(bt_row_ptr + n // block_size, mask=n_valid, other=0).to(tl.int64)
    kv_off = phys * stride_cb + (n % block_size) * stride_co + kvh * stride_ch
    kv_mask = n_valid[:, None] & d_mask[None, :]
    # An fp8 cache is widened to q's dtype here; its scales are folded into scale_log2e (K)
    # and into the final normalisation (V) by the callers.
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    qk = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2e  # [rows, BLOCK_N], log2 units
    if MASK_CAUSAL:
        qk = tl.where((n[None, :] <= q_pos[:, None]) & n_valid[None, :], qk, float("-inf"))
    else:
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    if MASK_CAUSAL:
        # A causal tile may hold keys no row of this step wrote: a prefill graph's padding rows
        # (executor/cuda_graphs.PrefillGraphs) count as the sequence's last positions but leave the
        # cache unwritten. A real row gives them p = 0, and 0 x NaN (or Inf) garbage would still
        # poison its sum, so any value that is not finite is read as 0.
        v = tl.where(tl.abs(v) < float("inf"), v, 0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, l_i


# --------------------------------------------------------------------------- extend / prefill


@triton.jit(do_not_specialize=["stride_bt"])  # the block table's width varies by step
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch, stride_bt,
    scale_log2e, v_scale, block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # grid: (cdiv(max_q_len * GROUP, BLOCK_M), num_seqs, num_kv_heads).
    # Tile row r is flat index f = pid_m * BLOCK_M + r over (query token, head in group):
    # token = f // GROUP, head = kvh * GROUP + f % GROUP.
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    f0 = pid_m * BLOCK_M
    if f0 >= q_len * GROUP:  # this sequence has fewer query rows
        return

    f = f0 + tl.arange(0, BLOCK_M)
    tok = f // GROUP
    head = kvh * GROUP + f % GROUP
    row_valid = tok < q_len
    q_pos = seq_len - q_len + tok  # absolute position of each row's query token
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt

    # Keys <= the tile's first query position are visible to every row: no causal mask.
    first_pos = seq_len - q_len + f0 // GROUP
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    last_tok = tl.minimum((f0 + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = seq_len - q_len + last_tok + 1  # one past the last key any row may see (<= seq_len)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, start, kv_end, q_pos, kvh,
            block_size, d, d_mask, stride_cb, stride_co, stride_ch, scale_log2e,
            MASK_CAUSAL=False, BLOCK_N=BLOCK_N, PRECISION=PRECISION, UPCAST=UPCAST)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, start, kv_end, q_pos, kvh,
            block_size, d, d_mask, stride_cb, stride_co, stride_ch, scale_log2e,
            MASK_CAUSAL=True, BLOCK_N=BLOCK_N, PRECISION=PRECISION, UPCAST=UPCAST)

    out = acc * (v_scale / l_i[:, None])
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_mask[None, :])


def _dot_flags(dtype):
    """PRECISION: fp32 inputs get exact fp32 dots (no TF32) so they match the reference.
    UPCAST: work around the interpreter's broken bf16 tl.dot (see _dot)."""
    return dict(PRECISION="ieee" if dtype == torch.float32 else None,
                UPCAST=interpret_mode() and dtype == torch.bfloat16)


def _extend_config(head_dim, rows_per_seq):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); Hopper-oriented, lightly tuned."""
    block_m = min(64, max(16, triton.next_power_of_2(rows_per_seq)))
    if head_dim <= 128:  # 32-key tiles: 8 x 1024 new tokens 176 us vs 187 for 64 (H200, attention_bench.py)
        return block_m, 32, 4, 3
    return block_m, 32, 4, 2


def _check_paged(q, k_cache, v_cache, block_tables):
    assert q.dim() == 3 and q.stride(-1) == 1, "q: [tokens, heads, head_dim], head_dim contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    assert q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] == k_cache.shape[3]
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1


def extend_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len, scale,
                            k_scale: float = 1.0, v_scale: float = 1.0, *, config: tuple | None = None):
    """config: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of _extend_config's (benchmarks)."""
    _check_paged(q, k_cache, v_cache, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0 or max_q_len == 0:
        return out
    block_m, block_n, num_warps, num_stages = config or _extend_config(head_dim, max_q_len * group)
    grid = (triton.cdiv(max_q_len * group, block_m), num_seqs, num_kv_heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * k_scale * LOG2E, v_scale, k_cache.shape[1],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, **_dot_flags(q.dtype),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(),
    )
    return out


def extend_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len: int, scale: float):
    """Causal attention for a flattened ragged batch (prefill chunks and decodes mixed).

    q [num_tokens, num_heads, head_dim] -> out, same shape and dtype. `max_q_len`
    (a host int, >= every q_len) sizes the grid, so no device->host sync happens.
    """
    if use_triton(q):
        return extend_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len, scale)
    return reference.extend_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len, scale)


# --------------------------------------------------------------------------- split-KV decode


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    # Keys per split for this sequence: a multiple of BLOCK_N, so short sequences use
    # fewer (non-empty) splits. The decode kernel and its merge must agree on it.
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _visible_keys(seq_lens_ptr, query_lens_ptr, seq, NUM_Q: tl.constexpr):
    # (seq_len, the keys every query row of the sequence sees, the real query rows). With NUM_Q
    # query rows per sequence, the first query_len are real and the rest repeat the last real
    # row's bound, so no row reads a key past seq_len. The splits cut only the common keys, so
    # every non-empty split holds a key each row sees (no all-masked row); the last used split
    # also takes the step's other new keys, under the causal mask.
    seq_len = tl.load(seq_lens_ptr + seq)
    if NUM_Q == 1:
        return seq_len, seq_len, 1
    q_len = tl.load(query_lens_ptr + seq)
    return seq_len, tl.maximum(seq_len - q_len + 1, 0), q_len


@triton.jit(do_not_specialize=["stride_bt", "stride_ps", "num_splits"])  # vary by step
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, query_lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    stride_qs, stride_qh, stride_cb, stride_co, stride_ch, stride_bt,
    stride_ps, stride_ph, stride_os, stride_oh,
    scale_log2e, v_scale, block_size, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    DIRECT: tl.constexpr, PDL: tl.constexpr, NUM_Q: tl.constexpr = 1,
):
    # grid: (num_seqs, num_kv_heads, num_splits). Rows = (query row t < NUM_Q, head in group)
    # flattened t * GROUP + h, over kv head kvh: every K/V tile is loaded once for all of them.
    # Query row t of sequence s is q row s * NUM_Q + t, at position seq_len - query_len + t.
    # DIRECT (one split): the program writes `out` (zeros for a sequence of length 0, a padded
    # graph row). Otherwise each non-empty split writes, per row, its normalised partial
    # output and log2-sum-exp (part_o [rows, heads, splits, D], part_lse [rows, heads, splits])
    # for _decode_merge_kernel; empty splits write nothing.
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)  # the merge, or at batch 1 the o_proj GEMV (which prefetches weights)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    h = tl.arange(0, BLOCK_H)
    if NUM_Q == 1:
        tok = tl.zeros([BLOCK_H], tl.int32)
        h_valid = h < GROUP
        head = kvh * GROUP + h
    else:
        tok = h // GROUP
        h_valid = h < NUM_Q * GROUP
        head = kvh * GROUP + h % GROUP
    q_row = seq.to(tl.int64) * NUM_Q + tok
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    io_mask = h_valid[:, None] & d_mask[None, :]
    # q does not depend on the split's bounds: its load is issued with seq_len's
    q = tl.load(q_ptr + q_row[:, None] * stride_qs + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    seq_len, common, q_len = _visible_keys(seq_lens_ptr, query_lens_ptr, seq, NUM_Q)
    split_len = _split_len(common, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, common)
    o_off = q_row[:, None] * stride_os + head[:, None] * stride_oh + d[None, :]
    if start >= end:
        if DIRECT:  # only when seq_len == 0
            tl.store(out_ptr + o_off, tl.zeros([BLOCK_H, BLOCK_D], out_ptr.dtype.element_ty), mask=io_mask)
        return

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    if NUM_Q == 1:
        for s in range(start, end, BLOCK_N):  # decode query sees every key: only mask n >= end
            acc, m_i, l_i = _attend_tile(  # (q_pos argument `h` is unused without the causal mask)
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, s, end, h, kvh,
                block_size, d, d_mask, stride_cb, stride_co, stride_ch, scale_log2e,
                MASK_CAUSAL=False, BLOCK_N=BLOCK_N, PRECISION=PRECISION, UPCAST=UPCAST)
    else:
        q_pos = seq_len - q_len + tl.minimum(tok, q_len - 1)
        end = tl.where(end == common, seq_len, end)
        for s in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, s, end, q_pos, kvh,
                block_size, d, d_mask, stride_cb, stride_co, stride_ch, scale_log2e,
                MASK_CAUSAL=True, BLOCK_N=BLOCK_N, PRECISION=PRECISION, UPCAST=UPCAST)

    o = acc * (v_scale / l_i[:, None])
    if DIRECT:
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        p_row = q_row * stride_ps + head * stride_ph + split  # [BLOCK_H] (split stride 1)
        tl.store(part_o_ptr + p_row[:, None] * HEAD_DIM + d[None, :], o, mask=io_mask)
        tl.store(part_lse_ptr + p_row, m_i + tl.log2(l_i), mask=h_valid)


@triton.jit(do_not_specialize=["stride_ps", "num_splits"])
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, query_lens_ptr,
    stride_ps, stride_ph, stride_os, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr, NUM_Q: tl.constexpr = 1,
):
    # grid: (num_seqs * NUM_Q, num_heads). out = sum_s w_s * o_s / sum_s w_s over the used splits,
    # w_s = 2^(lse_s - max lse), BLOCK_S splits per tile (a constant: no split count compiles a
    # variant of its own; one tile in the usual case). A sequence of length 0 gets zeros.
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)  # at batch 1 the o_proj GEMV follows: it prefetches its weights meanwhile
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len, common, q_len = _visible_keys(seq_lens_ptr, query_lens_ptr, row // NUM_Q, NUM_Q)
    n_used = tl.cdiv(common, tl.maximum(_split_len(common, num_splits, BLOCK_N), 1))
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row0 = row.to(tl.int64) * stride_ps + head * stride_ph
    m = tl.full([1], float("-inf"), tl.float32)
    w_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n_used, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_valid = s < n_used
        lse = tl.load(part_lse_ptr + row0 + s, mask=s_valid, other=float("-inf"))
        o = tl.load(part_o_ptr + (row0 + s)[:, None] * HEAD_DIM + d[None, :], mask=s_valid[:, None] & d_mask[None, :],
                    other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite: every tile holds a used split
        rescale = tl.exp2(m - m_new)  # 0 on the first tile
        w = tl.exp2(lse - m_new)  # 0 for unused splits
        acc = acc * rescale + tl.sum(w[:, None] * o, 0)
        w_sum = w_sum * rescale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.maximum(w_sum, 1.0)  # w_sum >= 1 (the largest split has w = 1); 0 / 1 when no split
    tl.store(out_ptr + row.to(tl.int64) * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


MAX_KV_SPLITS = 64  # the most splits a sequence's keys are cut into


def choose_num_kv_splits(num_seqs, num_kv_heads, max_context, device) -> int:
    """Enough (seq, kv head, split) programs for ~2 waves over the SMs, but no split
    shorter than 256 keys at max_context. Host-side only: never reads seq_lens."""
    sms = num_sms(device)
    want = triton.cdiv(2 * sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context, 256), MAX_KV_SPLITS))


DECODE_BLOCK_N = 64


def _decode_config(head_dim, num_seqs, num_kv_heads, num_splits, device):
    """(BLOCK_N keys per tile, num_warps, num_stages) of the decode kernel, from one H200 run of
    benchmarks/attention_bench.py at `97d7852` (bf16, head_dim 128; us per call, against the
    earlier fixed (64, 4, 3)):
      * unsplit and >= 4 (sequence, kv head) programs per SM: 128-key tiles, a 2-stage ring:
        256 sequences x 8 kv heads 273 us (97% of copy bandwidth) vs 287; 128 x 8: 183 vs 195;
      * fewer than a quarter of the SMs' worth of (sequence, kv head) pairs (batch 1-4 with 8 kv
        heads), whose splits are a tile or two long: no pipelining, batch 1 at 576 keys 6.1 vs 6.7;
      * between: 64-key tiles, 2 stages: 32 sequences (2 splits) 60.9 vs 74.6.
    Head dims above 128 halve the tile (shared memory)."""
    sms = num_sms(device)
    pairs = num_seqs * num_kv_heads
    if num_splits == 1 and pairs >= 4 * sms:
        block_n, num_stages = 2 * DECODE_BLOCK_N, 2
    else:
        block_n, num_stages = DECODE_BLOCK_N, (1 if 4 * pairs < sms else 2)
    return (block_n if head_dim <= 128 else block_n // 2), 4, num_stages


def decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_kv_splits=None,
                            k_scale: float = 1.0, v_scale: float = 1.0, *, num_queries: int = 1,
                            query_lens: torch.Tensor | None = None, config: tuple | None = None):
    """Split-KV decode of `num_queries` query rows per sequence (q [num_seqs * num_queries, heads,
    head_dim]; the rows of sequence s are s * num_queries ..). With num_queries > 1 (a verify
    step), `query_lens` (int32 [num_seqs], 1..num_queries) says how many of them are real: real
    row t sits at position seq_len - query_len + t and sees keys up to it (causal); a row past
    query_len repeats the last real row's bound (its output is defined, and ignored). Everything
    about the launch comes from shapes and host ints: it replays inside CUDA graphs.
    config: (BLOCK_N, num_warps, num_stages) instead of _decode_config's (benchmarks)."""
    _check_paged(q, k_cache, v_cache, block_tables)
    num_rows, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    assert num_rows == num_seqs * num_queries, (num_rows, num_seqs, num_queries)
    assert (query_lens is not None) == (num_queries > 1), "query_lens goes with num_queries > 1"
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty((num_rows, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_kv_splits is None:
        max_context = block_tables.shape[1] * k_cache.shape[1]
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_context, q.device)
    assert 1 <= num_kv_splits <= MAX_KV_SPLITS, num_kv_splits
    block_n, num_warps, num_stages = config or _decode_config(head_dim, num_seqs, num_kv_heads, num_kv_splits,
                                                              q.device)
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(16, triton.next_power_of_2(group * num_queries))
    if block_h >= 128:  # e.g. 9 query rows x a GQA group of 8: 4 warps spill at sm_90 (8 do not)
        num_warps = max(num_warps, 8)
    direct = num_kv_splits == 1
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty((num_rows, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_rows, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    query_lens = seq_lens if query_lens is None else query_lens  # unread with one query row
    _decode_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_lens, part_o, part_lse, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_heads * num_kv_splits, num_kv_splits, out.stride(0), out.stride(1),
        scale * k_scale * LOG2E, v_scale, k_cache.shape[1], num_kv_splits,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=block_h, BLOCK_N=block_n,
        **_dot_flags(q.dtype), DIRECT=direct, NUM_Q=num_queries, num_warps=num_warps, num_stages=num_stages,
        **pdl_args(),
    )
    if not direct:
        _decode_merge_kernel[(num_rows, num_heads)](
            part_o, part_lse, out, seq_lens, query_lens,
            num_heads * num_kv_splits, num_kv_splits, out.stride(0), out.stride(1), num_kv_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=16, BLOCK_N=block_n, NUM_Q=num_queries, num_warps=4,
            **pdl_args(),
        )
    return out


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, num_kv_splits: int | None = None):
    """One query token per sequence, at its last position: q [num_seqs, num_heads, head_dim] -> out.

    Split-KV flash decoding: each sequence's keys are cut into up to num_kv_splits
    chunks processed in parallel, then merged by log-sum-exp. None: chosen from the
    SM count, batch size and the block table's capacity (no device->host sync).
    """
    if use_triton(q):
        return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_kv_splits)
    return reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_kv_splits)
