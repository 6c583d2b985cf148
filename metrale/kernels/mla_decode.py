"""Absorbed MLA attention over the paged latent cache: split-KV flash decoding as MQA.

Layout (layers/mla/backend.py):
  cache         [num_blocks, block_size, latent + rope], contiguous: per token the latent c_kv
                (kv_lora_rank wide) then the shared roped key k_pe; float32, bf16, fp16, or
                float8_e4m3fn (value = stored x latent_scale)
  q_latent      [R, heads, latent]  q_nope @ W_UK, the query over the latent
  q_pe          [R, heads, rope]    the roped query
  block_tables  int32 [num_seqs, max_blocks]; position p of sequence i lives in block
                block_tables[i, p // block_size] at offset p % block_size
Row r reads sequence r and sees its keys 0..seq_lens[r]-1 (a decode step), or, with a row map,
sequence row_seq[r] and keys 0..row_kv_len[r]-1 (any query row: its position + 1). With
`topk_indices` [R, K] (contract: docs/mla.md) row r sees only the listed positions; -1 entries
and positions >= its key count (a padded CUDA-graph row has none) are ignored.

out[r, h] = softmax_s(scale * [q_latent | q_pe][r, h] . cache[s]) @ cache[s, :latent]

Every head of a row reads the same latent, so a program owns BLOCK_H heads of one row and one
split of its keys: each latent tile is loaded from memory once for all of them and serves as
both key and value. Partial outputs of the splits are merged by log-sum-exp; with one split the
program writes the output directly. The split count depends only on the row count, the head
count and the block table's width (or K), never on device values, so decode replays in CUDA
graphs. Softmax is online in fp32 with exp2; P is cast to the query dtype for P @ V.

`_mla_decode_halves_kernel` is the same computation over the latent in two halves (VARIANTS,
picked by a config): Hopper's 64-row wgmma tiles without the spills a 512-wide fp32 accumulator
causes in _mla_decode_kernel; its split_v form is the large-batch default (LARGE_BATCH_CONFIG,
docs/mla.md).
"""

from __future__ import annotations

import torch

from metrale.kernels import interpret_mode, num_sms, pdl_args, pdl_wait, tl, triton
from metrale.kernels.paged_attention import LOG2E, _dot

# Hopper tiles from benchmarks/mla_decode_bench.py --sweep on an H200 (2026-12-02, 4k contexts,
# 128 heads): 32 heads x 64 tokens x 8 warps beat the first guess (32 x 32) at every batch
# (batch 1 21.0 against 25.2 us, batch 64 656 against 955, batch 256 2421 against 3878) and
# compiles for sm_90 without spills (206 registers; tests/kernels/compile_sm90.py). 64 heads x 32
# tokens was faster again at batch 64 and 256 (550, 2049 us) but spills at sm_90; all of them are
# far from the floor (docs/mla.md). 128 heads in blocks of 32 read each latent tile four times,
# three of them from L2.
BLOCK_H = 32
BLOCK_N = 64
FP8_BLOCK_N = 32  # an e4m3 cache's converted tiles need the registers: 64 tokens spill at sm_90
NUM_WARPS = 8
NUM_STAGES = 2
# A split's partial is heads x 512 fp32 values (256 KiB at 128 heads): at batch 1, 32 splits
# write and merge 8 MiB against 4.7 MB of latents at 4k (in L2, mostly), and 32 splits x 4 head
# blocks already fill an H200's 132 SMs once.
MAX_KV_SPLITS = 32
MIN_KEYS_PER_SPLIT = 128  # shorter splits spend more on the merge than they win in parallelism
# Latent layouts of a program (a config's optional fifth element): "whole" is _mla_decode_kernel;
# "halves" and "split_v" are _mla_decode_halves_kernel ("split_v" runs two value programs per
# head block, each recomputing QK^T).
VARIANTS = {"whole": None, "halves": 1, "split_v": 2}  # name -> V_PROGRAMS
# Dense decode of 16+ rows over 128+ heads in bf16: split_v with 128-head programs (each warpgroup
# 64 heads: QK^T at n32, P@V at n256 on wgmma), timed on an H200 at 128 heads and 4k contexts:
# batch 64 398 against 661 us for the default, batch 256 1,483 against 2,420; at batch 1 the
# default is faster (21.3 against 23.7 us). Only that case was timed and checked on the GPU
# (no row map, no selection, a bf16 cache), so only it takes this config.
LARGE_BATCH_CONFIG = (128, 32, 8, 2, "split_v")
LARGE_BATCH_MIN_ROWS = 16


@triton.jit
def _split_keys(row, split, seq_lens_ptr, row_seq_ptr, row_kv_len_ptr, bt_ptr, stride_bt, num_splits, num_topk,
                BLOCK_N: tl.constexpr, ROW_MAP: tl.constexpr, SPARSE: tl.constexpr):
    # Row `row`'s key count, this split's [start, end) of its keys (positions, or entries of its
    # selection when SPARSE), and its block-table row.
    if ROW_MAP:
        seq = tl.load(row_seq_ptr + row)
        kv_len = tl.load(row_kv_len_ptr + row)
    else:
        seq = row
        kv_len = tl.load(seq_lens_ptr + row)
    if SPARSE:
        n_keys = num_topk
    else:
        n_keys = kv_len
    split_len = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, n_keys)
    return kv_len, start, end, bt_ptr + seq.to(tl.int64) * stride_bt


@triton.jit
def _tile_entries(s, end, kv_len, row64, topk_ptr, stride_tk, bt_row_ptr, block_size, stride_cb, stride_co,
                  BLOCK_N: tl.constexpr, SPARSE: tl.constexpr):
    # The BLOCK_N keys from `s`: which are real (inside the split; a selection's -1 padding and
    # positions past the row's keys are not) and their cache entries' offsets (0 where not real).
    j = s + tl.arange(0, BLOCK_N)
    valid = j < end
    if SPARSE:
        pos = tl.load(topk_ptr + row64 * stride_tk + j, mask=valid, other=-1)
        valid = valid & (pos >= 0) & (pos < kv_len)
    else:
        pos = j
    pos = tl.where(valid, pos, 0)
    phys = tl.load(bt_row_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
    return valid, phys * stride_cb + (pos % block_size) * stride_co


@triton.jit(do_not_specialize=["stride_bt", "stride_tk", "num_splits", "num_topk"])
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, bt_ptr, seq_lens_ptr, row_seq_ptr, row_kv_len_ptr, topk_ptr,
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_cb, stride_co, stride_bt, stride_tk,
    stride_ot, stride_oh,
    num_heads, block_size, num_splits, num_topk, scale_log2e, v_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, ROW_MAP: tl.constexpr, SPARSE: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (cdiv(heads, BLOCK_H), num_splits, rows): the head blocks of one (row, split) are
    # neighbours in launch order, so they run together and all but the first find the latent
    # tiles in L2. Partials: part_o [rows, heads, splits,
    # LATENT] fp32 (normalised), part_lse [rows, heads, splits] (log2-sum-exp, -inf: the split
    # saw no key). Every split writes its partial, empty or not, so the merge needs no count.
    pdl_wait(PDL)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    row = tl.program_id(2)
    h_valid = h < num_heads
    dl = tl.arange(0, BLOCK_L)
    dl_mask = dl < LATENT
    dr = tl.arange(0, BLOCK_R)
    dr_mask = dr < ROPE
    row64 = row.to(tl.int64)
    q_lat = tl.load(q_lat_ptr + row64 * stride_qlt + h[:, None] * stride_qlh + dl[None, :],
                    mask=h_valid[:, None] & dl_mask[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + row64 * stride_qpt + h[:, None] * stride_qph + dr[None, :],
                   mask=h_valid[:, None] & dr_mask[None, :], other=0.0)
    kv_len, start, end, bt_row_ptr = _split_keys(row, split, seq_lens_ptr, row_seq_ptr, row_kv_len_ptr, bt_ptr,
                                                  stride_bt, num_splits, num_topk, BLOCK_N, ROW_MAP, SPARSE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for s in range(start, end, BLOCK_N):
        valid, off = _tile_entries(s, end, kv_len, row64, topk_ptr, stride_tk, bt_row_ptr, block_size, stride_cb,
                                   stride_co, BLOCK_N, SPARSE)
        kv = tl.load(cache_ptr + off[:, None] + dl[None, :], mask=valid[:, None] & dl_mask[None, :],
                     other=0.0).to(q_lat.dtype)
        pe = tl.load(cache_ptr + off[:, None] + LATENT + dr[None, :], mask=valid[:, None] & dr_mask[None, :],
                     other=0.0).to(q_lat.dtype)
        qk = _dot(q_lat, tl.trans(kv), PRECISION, UPCAST) + _dot(q_pe, tl.trans(pe), PRECISION, UPCAST)
        qk = tl.where(valid[None, :], qk * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A tile with no key yet (a sparse row's padding) keeps m at -inf: exponentiate against
        # 0 then, so every term is exp2(-inf) = 0 and no NaN appears.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(kv.dtype), kv, PRECISION, UPCAST)
        m_i = m_new

    o = acc * (v_scale / tl.maximum(l_i, 1e-30)[:, None])  # 0 for a row that saw no key
    io_mask = h_valid[:, None] & dl_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + row64 * stride_ot + h[:, None] * stride_oh + dl[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        p_row = (row64 * num_heads + h) * num_splits + split
        tl.store(part_o_ptr + p_row[:, None] * LATENT + dl[None, :], o, mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + p_row, lse, mask=h_valid)


@triton.jit(do_not_specialize=["stride_bt", "stride_tk", "num_splits", "num_topk"])
def _mla_decode_halves_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, bt_ptr, seq_lens_ptr, row_seq_ptr, row_kv_len_ptr, topk_ptr,
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_cb, stride_co, stride_bt, stride_tk,
    stride_ot, stride_oh,
    num_heads, block_size, num_splits, num_topk, scale_log2e, v_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, ROW_MAP: tl.constexpr, SPARSE: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
    V_PROGRAMS: tl.constexpr,
):
    # _mla_decode_kernel with the latent in two halves of HALF = BLOCK_L / 2 columns, so that a
    # 64-head tile (wgmma's M) keeps its fp32 value accumulator in registers: QK^T is
    # q_a . kv_a + q_b . kv_b + q_pe . pe. V_PROGRAMS 1 ("halves"): one program holds both value
    # halves as two [BLOCK_H, HALF] accumulators (two P @ V dots). V_PROGRAMS 2 ("split_v"): the
    # value dimension is split over two programs, program_id(0) = head block * 2 + half; each
    # recomputes the whole QK^T (1.5x the FLOPs) and accumulates its own half only (half "a" is
    # its value half, "b" the other). Same grid order, partials and merge as _mla_decode_kernel;
    # with two value programs only half 0 writes the log-sum-exp (both compute the same one).
    pdl_wait(PDL)
    HALF: tl.constexpr = BLOCK_L // 2
    head_block = tl.program_id(0) // V_PROGRAMS
    v_half = tl.program_id(0) % V_PROGRAMS
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    row = tl.program_id(2)
    h_valid = h < num_heads
    da = v_half * HALF + tl.arange(0, HALF)  # the first value half, or this program's
    db = (1 - v_half) * HALF + tl.arange(0, HALF)
    da_mask = da < LATENT
    db_mask = db < LATENT
    dr = tl.arange(0, BLOCK_R)
    dr_mask = dr < ROPE
    row64 = row.to(tl.int64)
    q_row = q_lat_ptr + row64 * stride_qlt + h[:, None] * stride_qlh
    q_a = tl.load(q_row + da[None, :], mask=h_valid[:, None] & da_mask[None, :], other=0.0)
    q_b = tl.load(q_row + db[None, :], mask=h_valid[:, None] & db_mask[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + row64 * stride_qpt + h[:, None] * stride_qph + dr[None, :],
                   mask=h_valid[:, None] & dr_mask[None, :], other=0.0)
    kv_len, start, end, bt_row_ptr = _split_keys(row, split, seq_lens_ptr, row_seq_ptr, row_kv_len_ptr, bt_ptr,
                                                  stride_bt, num_splits, num_topk, BLOCK_N, ROW_MAP, SPARSE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc_b = tl.zeros([BLOCK_H, HALF], tl.float32)  # unused with two value programs
    for s in range(start, end, BLOCK_N):
        valid, off = _tile_entries(s, end, kv_len, row64, topk_ptr, stride_tk, bt_row_ptr, block_size, stride_cb,
                                   stride_co, BLOCK_N, SPARSE)
        entry = cache_ptr + off[:, None]
        kv_a = tl.load(entry + da[None, :], mask=valid[:, None] & da_mask[None, :], other=0.0).to(q_a.dtype)
        kv_b = tl.load(entry + db[None, :], mask=valid[:, None] & db_mask[None, :], other=0.0).to(q_a.dtype)
        pe = tl.load(entry + LATENT + dr[None, :], mask=valid[:, None] & dr_mask[None, :],
                     other=0.0).to(q_a.dtype)
        qk = (_dot(q_a, tl.trans(kv_a), PRECISION, UPCAST) + _dot(q_b, tl.trans(kv_b), PRECISION, UPCAST)
              + _dot(q_pe, tl.trans(pe), PRECISION, UPCAST))
        qk = tl.where(valid[None, :], qk * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # as in _mla_decode_kernel: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(kv_a.dtype)
        acc_a = acc_a * alpha[:, None] + _dot(p, kv_a, PRECISION, UPCAST)
        if V_PROGRAMS == 1:
            acc_b = acc_b * alpha[:, None] + _dot(p, kv_b, PRECISION, UPCAST)
        m_i = m_new

    inv_l = v_scale / tl.maximum(l_i, 1e-30)  # 0 for a row that saw no key
    p_row = (row64 * num_heads + h) * num_splits + split
    if DIRECT:
        out_row = out_ptr + row64 * stride_ot + h[:, None] * stride_oh
        tl.store(out_row + da[None, :], (acc_a * inv_l[:, None]).to(out_ptr.dtype.element_ty),
                 mask=h_valid[:, None] & da_mask[None, :])
        if V_PROGRAMS == 1:
            tl.store(out_row + db[None, :], (acc_b * inv_l[:, None]).to(out_ptr.dtype.element_ty),
                     mask=h_valid[:, None] & db_mask[None, :])
    else:
        tl.store(part_o_ptr + p_row[:, None] * LATENT + da[None, :], acc_a * inv_l[:, None],
                 mask=h_valid[:, None] & da_mask[None, :])
        if V_PROGRAMS == 1:
            tl.store(part_o_ptr + p_row[:, None] * LATENT + db[None, :], acc_b * inv_l[:, None],
                     mask=h_valid[:, None] & db_mask[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        if v_half == 0:
            tl.store(part_lse_ptr + p_row, lse, mask=h_valid)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads, num_splits,
    LATENT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (rows, heads). out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max); zeros when no
    # split saw a key (a padded graph row). BLOCK_S splits per tile: one tile in the usual case.
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dl = tl.arange(0, BLOCK_L)
    dl_mask = dl < LATENT
    row0 = (row * num_heads + head) * num_splits
    m = tl.full([1], float("-inf"), tl.float32)
    w_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_valid = s < num_splits
        lse = tl.load(part_lse_ptr + row0 + s, mask=s_valid, other=float("-inf"))
        o = tl.load(part_o_ptr + (row0 + s)[:, None] * LATENT + dl[None, :],
                    mask=s_valid[:, None] & dl_mask[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)
        acc = acc * rescale + tl.sum(w[:, None] * o, 0)
        w_sum = w_sum * rescale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.maximum(w_sum, 1e-30)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dl, out.to(out_ptr.dtype.element_ty), mask=dl_mask)


def choose_num_kv_splits(num_rows: int, num_head_blocks: int, max_keys: int, device: torch.device) -> int:
    """About two waves of (row, head block, split) programs over the SMs, no split shorter than
    MIN_KEYS_PER_SPLIT of `max_keys` (the block table's capacity, or K). Host-side only."""
    want = triton.cdiv(2 * num_sms(device), max(1, num_rows * num_head_blocks))
    return max(1, min(want, triton.cdiv(max_keys, MIN_KEYS_PER_SPLIT), MAX_KV_SPLITS))


def default_config(rows: int, heads: int, cache_dtype: torch.dtype, mapped_or_sparse: bool) -> tuple:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages[, variant]) for a launch: the measured large-batch
    config where it was measured (see LARGE_BATCH_CONFIG), else the module's defaults."""
    if cache_dtype == torch.float8_e4m3fn:
        return BLOCK_H, FP8_BLOCK_N, NUM_WARPS, NUM_STAGES
    if rows >= LARGE_BATCH_MIN_ROWS and heads >= LARGE_BATCH_CONFIG[0] and not mapped_or_sparse:
        return LARGE_BATCH_CONFIG
    return BLOCK_H, BLOCK_N, NUM_WARPS, NUM_STAGES


def mla_decode_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                         row_seq: torch.Tensor | None = None, row_kv_len: torch.Tensor | None = None,
                         topk_indices: torch.Tensor | None = None, latent_scale: float = 1.0,
                         num_kv_splits: int | None = None, config: tuple | None = None) -> torch.Tensor:
    """-> [R, heads, latent] in q_latent's dtype (the attended latent, before W_UV).

    `row_seq`, `row_kv_len` (int32 [R], both or neither): row r's sequence and key count; None:
    row r is sequence r with seq_lens[r] keys. `config`: (BLOCK_H, BLOCK_N, num_warps,
    num_stages[, variant]) instead of the module's defaults (the benchmark's sweep); variant, a
    key of VARIANTS, defaults to "whole"."""
    rows, heads, latent = q_latent.shape
    rope = q_pe.shape[2]
    assert q_pe.shape[:2] == (rows, heads) and q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1
    assert q_pe.dtype == q_latent.dtype
    assert cache.dim() == 3 and cache.shape[2] == latent + rope and cache.is_contiguous()
    assert cache.dtype in (q_latent.dtype, torch.float8_e4m3fn), (cache.dtype, q_latent.dtype)
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert (row_seq is None) == (row_kv_len is None)
    sparse = topk_indices is not None
    if sparse:
        assert topk_indices.dtype == torch.int32 and topk_indices.shape[0] == rows and topk_indices.stride(-1) == 1
    out = torch.empty((rows, heads, latent), dtype=q_latent.dtype, device=q_latent.device)
    if rows == 0:
        return out
    if config is None:
        config = default_config(rows, heads, cache.dtype, mapped_or_sparse=row_seq is not None or sparse)
    block_h, block_n, num_warps, num_stages, *variant = config
    variant = variant[0] if variant else "whole"
    if variant not in VARIANTS:
        raise ValueError(f"MLA decode variant {variant!r}: not one of {sorted(VARIANTS)}")
    v_programs = VARIANTS[variant]
    block_h = max(16, min(block_h, triton.next_power_of_2(heads)))  # tl.dot needs 16 rows
    if v_programs is not None and triton.next_power_of_2(latent) < 32:
        raise ValueError(f"MLA decode variant {variant!r} needs a latent of at least 32 (halves of 16 "
                         f"for tl.dot), not {latent}")
    head_blocks = triton.cdiv(heads, block_h) * (v_programs or 1)  # programs along the grid's first axis
    if num_kv_splits is None:
        max_keys = topk_indices.shape[1] if sparse else block_tables.shape[1] * cache.shape[1]
        num_kv_splits = choose_num_kv_splits(rows, head_blocks, max_keys, q_latent.device)
    assert 1 <= num_kv_splits <= MAX_KV_SPLITS, num_kv_splits
    direct = num_kv_splits == 1
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty((rows, heads, num_kv_splits, latent), dtype=torch.float32, device=q_latent.device)
        part_lse = torch.empty((rows, heads, num_kv_splits), dtype=torch.float32, device=q_latent.device)
    dummy = block_tables  # stands in for the pointers a variant does not read
    float32 = q_latent.dtype == torch.float32
    assert rows < 65536, f"{rows} query rows in one launch: the grid's third dimension holds 65535"
    kernel = _mla_decode_kernel if v_programs is None else _mla_decode_halves_kernel
    extra = {} if v_programs is None else {"V_PROGRAMS": v_programs}
    kernel[(head_blocks, num_kv_splits, rows)](
        q_latent, q_pe, cache, block_tables, seq_lens,
        row_seq if row_seq is not None else dummy, row_kv_len if row_kv_len is not None else dummy,
        topk_indices if sparse else dummy, part_o, part_lse, out,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), topk_indices.stride(0) if sparse else 0, out.stride(0), out.stride(1),
        heads, cache.shape[1], num_kv_splits, topk_indices.shape[1] if sparse else 0,
        scale * latent_scale * LOG2E, latent_scale,
        LATENT=latent, ROPE=rope, BLOCK_L=triton.next_power_of_2(latent), BLOCK_R=triton.next_power_of_2(rope),
        BLOCK_H=block_h, BLOCK_N=block_n, ROW_MAP=row_seq is not None, SPARSE=sparse, DIRECT=direct,
        PRECISION="ieee" if float32 else None, UPCAST=interpret_mode() and q_latent.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages, **extra, **pdl_args(),
    )
    if not direct:
        _mla_merge_kernel[(rows, heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), heads, num_kv_splits,
            LATENT=latent, BLOCK_L=triton.next_power_of_2(latent), BLOCK_S=16, num_warps=4, **pdl_args(),
        )
    return out
