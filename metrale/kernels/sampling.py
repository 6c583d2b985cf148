"""Token sampling: greedy / temperature / top-k / top-p / min-p, sort-free, one kernel.

Semantics are those of reference.filter_logits (read its docstring); in short,
per row, l = logits / temperature and the kept set is {l >= t} ∩ {exp(l - max) >= min_p}
where t is the top-k threshold raised by top-p. Every filter keeps a prefix of the
tokens sorted by l, so each is found as a threshold on l by bisection, without sorting:

  * l is mapped to a monotone int32 key (fp32 bits, negatives' magnitude bits flipped),
  * top-k: t_k = largest key t with count(key >= t) >= k      (32 bisection passes),
  * top-p: t_p = largest key t >= t_k with sum_{key >= t} e^(l-max) >= top_p * Z,
    Z the same sum over the top-k survivors                    (1 + 32 passes),
  * then a Gumbel-max draw: argmax over kept tokens of l + g, g = -log(-log(u)),
    u = tl.rand(seed, offset * vocab + token_index).

Each row's result depends only on its own logits, parameters and (seed, offset):
the same inputs give the same token in any batch, at any batch position. No
device->host sync happens (the caller reads the result when it needs it).
Rows that do not use top-k / top-p skip those passes.

That kernel gives each row to one program, so a few rows leave most of the GPU idle. When
the caller knows that no row of the batch uses top-k or top-p (no thresholds to search) and
the batch has fewer rows than the GPU has SMs, the vocab-parallel path runs instead: the row is cut into chunks, one program per (row,
chunk) finds its chunk's max (only when a row uses min-p, which compares with the row max),
then its chunk's best Gumbel-max score and index, and a last program per row picks the
best chunk (the earliest on ties). Max and argmax are exact, the noise is the same function
of (seed, offset, token), so both paths draw the same token for such a row.
"""

from __future__ import annotations

import torch

from metrale.kernels import interpret_mode, reference, tl, triton, use_triton

SAMPLING_EPS = reference.SAMPLING_EPS
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


@triton.jit
def _scaled(logits_ptr, row_off, v, mask, temp):
    # l = logits / temperature (temperature 1 for greedy rows); -inf where masked
    # (outside the vocab or a padding row). IEEE division, as in the reference.
    x = tl.load(logits_ptr + row_off[:, None] + v, mask=mask, other=float("-inf"))
    return tl.div_rn(x, temp[:, None])


@triton.jit
def _key(l):
    # Monotone map fp32 -> int32: a < b  <=>  key(a) < key(b) (for non-NaN a, b).
    b = l.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _sample_kernel(
    logits_ptr, out_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr,
    n_rows, vocab, stride_row, eps,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # ROWS rows per program, each row independent of the others (batch invariance);
    # every pass below streams the row's logits in BLOCK_V chunks.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_valid = rows < n_rows
    row_off = rows.to(tl.int64) * stride_row
    temp = tl.load(temp_ptr + rows, mask=row_valid, other=1.0)
    greedy = temp < eps
    temp = tl.where(greedy, 1.0, temp)
    top_k = tl.load(top_k_ptr + rows, mask=row_valid, other=0).to(tl.int64)
    top_p = tl.load(top_p_ptr + rows, mask=row_valid, other=1.0)
    min_p = tl.load(min_p_ptr + rows, mask=row_valid, other=0.0)
    k_on = (top_k > 0) & (top_k < vocab) & ~greedy & row_valid
    p_on = (top_p < 1.0) & ~greedy & row_valid
    min_p = tl.where(greedy, 0.0, min_p)
    cols = tl.arange(0, BLOCK_V)[None, :]
    rv = row_valid[:, None]

    # Pass: row max of l.
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + cols
        m = tl.maximum(m, tl.max(_scaled(logits_ptr, row_off, v, rv & (v < vocab), temp), 1))
    m = tl.where(row_valid, m, 0.0)  # padding rows: avoid (-inf) - (-inf)

    # Top-k threshold. Invariant: count(key >= lo) >= k and the answer is in [lo, hi].
    lo = tl.full([ROWS], -2147483648, tl.int64)
    if tl.max(k_on.to(tl.int32), 0) > 0:
        hi = tl.full([ROWS], 2147483647, tl.int64)
        for _ in range(32):  # key range is 2^32 wide: 32 halvings leave lo == hi
            mid = (lo + hi + 1) >> 1
            cnt = tl.zeros([ROWS], tl.int64)
            for v0 in range(0, vocab, BLOCK_V):
                v = v0 + cols
                key = _key(_scaled(logits_ptr, row_off, v, rv & (v < vocab), temp))
                cnt += tl.sum(((key >= mid[:, None]) & rv & (v < vocab)).to(tl.int64), 1)
            ok = cnt >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        lo = tl.where(k_on, lo, -2147483648)
    t = lo  # top-k threshold key (INT32_MIN: keep all)

    # Top-p threshold over the top-k survivors. Invariant: mass(key >= lo) >= top_p * Z.
    if tl.max(p_on.to(tl.int32), 0) > 0:
        z = tl.zeros([ROWS], tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            v = v0 + cols
            l = _scaled(logits_ptr, row_off, v, rv & (v < vocab), temp)
            z += tl.sum(tl.where(_key(l) >= t[:, None], tl.exp(l - m[:, None]), 0.0), 1)
        target = top_p * z
        lo = t
        hi = tl.full([ROWS], 2147483647, tl.int64)
        for _ in range(32):
            mid = (lo + hi + 1) >> 1
            mass = tl.zeros([ROWS], tl.float32)
            for v0 in range(0, vocab, BLOCK_V):
                v = v0 + cols
                l = _scaled(logits_ptr, row_off, v, rv & (v < vocab), temp)
                mass += tl.sum(tl.where(_key(l) >= mid[:, None], tl.exp(l - m[:, None]), 0.0), 1)
            ok = mass >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        t = tl.where(p_on, lo, t)

    # Draw: Gumbel-max over kept tokens (greedy rows: plain argmax, first index on ties).
    seed = tl.load(seed_ptr + rows, mask=row_valid, other=0)
    counter0 = tl.load(offset_ptr + rows, mask=row_valid, other=0) * vocab
    best = tl.full([ROWS], float("-inf"), tl.float32)
    best_idx = tl.zeros([ROWS], tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + cols
        l = _scaled(logits_ptr, row_off, v, rv & (v < vocab), temp)
        keep = rv & (v < vocab) & (_key(l) >= t[:, None]) & (tl.exp(l - m[:, None]) >= min_p[:, None])
        u = tl.rand(seed[:, None], counter0[:, None] + v)
        gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        score = tl.where(keep, tl.where(greedy[:, None], l, l + gumbel), float("-inf"))
        blk_best = tl.max(score, 1)
        blk_idx = tl.argmax(score, 1, tie_break_left=True).to(tl.int64) + v0
        better = blk_best > best  # strict: the earlier index wins ties
        best = tl.where(better, blk_best, best)
        best_idx = tl.where(better, blk_idx, best_idx)
    tl.store(out_ptr + rows, best_idx, mask=row_valid)


@triton.jit
def _chunk_max_kernel(logits_ptr, chunk_max_ptr, temp_ptr, vocab, stride_row, num_chunks, eps,
                      BLOCK_V: tl.constexpr):
    # One program per (row, chunk): max of l over the chunk.
    row, chunk = tl.program_id(0), tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    temp = tl.where(temp < eps, 1.0, temp)
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + v, mask=v < vocab, other=float("-inf"))
    tl.store(chunk_max_ptr + row * num_chunks + chunk, tl.max(tl.div_rn(x, temp), 0))


@triton.jit
def _chunk_draw_kernel(logits_ptr, chunk_max_ptr, chunk_best_ptr, chunk_idx_ptr, temp_ptr, min_p_ptr, seed_ptr,
                       offset_ptr, vocab, stride_row, num_chunks, eps,
                       BLOCK_V: tl.constexpr, CHUNKS: tl.constexpr, USE_MIN_P: tl.constexpr):
    # One program per (row, chunk): the chunk's best score (l for greedy rows, l + Gumbel noise
    # otherwise) over kept tokens, and its index (the first on ties).
    row, chunk = tl.program_id(0), tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    greedy = temp < eps
    temp = tl.where(greedy, 1.0, temp)
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = v < vocab
    l = tl.div_rn(tl.load(logits_ptr + row.to(tl.int64) * stride_row + v, mask=in_vocab, other=float("-inf")), temp)
    keep = in_vocab
    if USE_MIN_P:
        c = tl.arange(0, CHUNKS)
        m = tl.max(tl.load(chunk_max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf")), 0)
        min_p = tl.where(greedy, 0.0, tl.load(min_p_ptr + row))
        keep = keep & (tl.exp(l - m) >= min_p)
    if greedy:
        score = tl.where(keep, l, float("-inf"))
    else:
        u = tl.rand(tl.load(seed_ptr + row), tl.load(offset_ptr + row) * vocab + v)
        gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        score = tl.where(keep, l + gumbel, float("-inf"))
    tl.store(chunk_best_ptr + row * num_chunks + chunk, tl.max(score, 0))
    tl.store(chunk_idx_ptr + row * num_chunks + chunk,
             tl.argmax(score, 0, tie_break_left=True).to(tl.int64) + chunk * BLOCK_V)


@triton.jit
def _pick_chunk_kernel(chunk_best_ptr, chunk_idx_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    # One program per row: the best chunk, the earliest on ties (so the first index overall).
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    best = tl.load(chunk_best_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    winner = tl.argmax(best, 0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(chunk_idx_ptr + row * num_chunks + winner))


def _sample_vocab_parallel(logits, temperature, min_p, seeds, offsets, out, use_min_p: bool):
    n, vocab = logits.shape
    block_v = 256 if interpret_mode() else 4096
    num_chunks = triton.cdiv(vocab, block_v)
    chunk_max = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_best = torch.empty_like(chunk_max)
    chunk_idx = torch.empty(n, num_chunks, dtype=torch.int64, device=logits.device)
    chunks_p2 = triton.next_power_of_2(num_chunks)
    if use_min_p:
        _chunk_max_kernel[(n, num_chunks)](logits, chunk_max, temperature, vocab, logits.stride(0), num_chunks,
                                           SAMPLING_EPS, BLOCK_V=block_v, num_warps=8)
    _chunk_draw_kernel[(n, num_chunks)](logits, chunk_max, chunk_best, chunk_idx, temperature, min_p, seeds, offsets,
                                        vocab, logits.stride(0), num_chunks, SAMPLING_EPS, BLOCK_V=block_v,
                                        CHUNKS=chunks_p2, USE_MIN_P=use_min_p, num_warps=8)
    _pick_chunk_kernel[(n,)](chunk_best, chunk_idx, out, num_chunks, CHUNKS=chunks_p2, num_warps=1)
    return out


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sample_tokens_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets, *,
                         any_top_k_or_top_p: bool = True, any_min_p: bool = True):
    """The flags say what the caller knows of the rows without reading the device: with
    any_top_k_or_top_p=False (no row filters by top-k or top-p) and fewer rows than the GPU has
    SMs (always under the interpreter, for the tests) the vocab-parallel path runs, and
    any_min_p=False (no row uses min-p) spares it the row max. Both flags are upper bounds: True
    is always correct. Either path draws the same token for a row, so the choice keeps batch
    invariance."""
    n, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    dev = logits.device
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    if not any_top_k_or_top_p and (interpret_mode() or n < _num_sms(dev)):
        # A batch with fewer rows than SMs leaves most of the GPU idle one row per program.
        return _sample_vocab_parallel(
            logits, temperature.to(device=dev, dtype=torch.float32).contiguous(),
            min_p.to(device=dev, dtype=torch.float32).contiguous(), seeds.to(device=dev, dtype=torch.int64).contiguous(),
            offsets.to(device=dev, dtype=torch.int64).contiguous(), out, any_min_p)
    # ROWS is a constant per platform, never a function of the batch: batch invariance.
    rows = 32 if interpret_mode() else 1
    _sample_kernel[(triton.cdiv(n, rows),)](
        logits, out,
        temperature.to(device=dev, dtype=torch.float32).contiguous(),
        top_k.to(device=dev, dtype=torch.int64).contiguous(),
        top_p.to(device=dev, dtype=torch.float32).contiguous(),
        min_p.to(device=dev, dtype=torch.float32).contiguous(),
        seeds.to(device=dev, dtype=torch.int64).contiguous(),
        offsets.to(device=dev, dtype=torch.int64).contiguous(),
        n, vocab, logits.stride(0), SAMPLING_EPS,
        ROWS=rows, BLOCK_V=min(triton.next_power_of_2(vocab), 4096), num_warps=8,
    )
    return out


def sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> torch.Tensor:
    """logits fp32 [n, vocab]; per-row temperature, top_k (0 or >= vocab: off), top_p (1: off),
    min_p (0: off), seeds int64, offsets int64 (e.g. the request's output position).
    Returns int64 [n] token ids on logits' device. Draws depend only on (seed, offset)."""
    if use_triton(logits):
        return sample_tokens_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return reference.sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets)
