"""Token sampling: greedy / temperature / top-k / top-p / min-p, sort-free, with no host sync.

Semantics are those of reference.filter_logits (read its docstring); in short, per row,
l = logits / temperature and the kept set is {l >= t} ∩ {exp(l - max) >= min_p} where t is the
top-k threshold raised by top-p. Every filter keeps a prefix of the tokens sorted by l, so each
is a threshold on a monotone int32 key of l (fp32 bits, negatives' magnitude bits flipped):

  * top-k: t_k = the k-th largest key,
  * top-p: t_p = the largest key t >= t_k whose mass, sum_{key >= t} e^(l - max), reaches
    top_p * Z, Z the same sum over the top-k survivors,
  * then a Gumbel-max draw: argmax over kept tokens of l + g, g = -log(-log(u)), where token
    n of a row takes 32-bit word n % 4 of Philox-4x32-10(seed, offset * ceil(vocab / 4) + n // 4)
    as u (`_gumbel`): one Philox call serves four neighbouring tokens.

Rows are cut into chunks of 4096 tokens and every pass runs one program per (row, chunk), so a
single row uses the whole GPU:

  1. chunk maxima of l (when a row needs the max: top-p or min-p);
  2. thresholds by radix select, 8 bits of the key per round, 4 rounds per threshold: each
     (row, chunk) adds its tokens' counts (top-k) or masses (top-p) into the row's 256 bins of
     the current digit, among the tokens whose higher digits match the prefix found so far;
     then one program per row picks the bin where the total from the top crosses k or the
     target. Masses are fixed point (e^(l - max) * 2^40 as int64), so the sums, done with
     atomics, are exact and in no particular order: deterministic;
  3. each (row, chunk) finds its best Gumbel score and index among kept tokens; one program per
     row picks the best chunk (the earliest on ties, so the first index overall).

A batch with at least as many rows as the GPU has SMs fills it by rows alone and takes one
program per row instead (`_row_sample_kernel`: no partials, no atomics), finding the same
thresholds by bisection over the same integer counts and fixed-point masses. Both paths draw
the same token for a row: the thresholds are the same keys, max and argmax are exact, and the
noise is the same function of (seed, offset, index). So a row's token depends only on its own
logits, parameters and (seed, offset): the same in any batch, at any position in it.
"""

from __future__ import annotations

import torch

from metrale.kernels import interpret_mode, num_sms, reference, tl, triton, use_triton

SAMPLING_EPS = reference.SAMPLING_EPS
INT32_MIN = -(2**31)
# Fixed-point unit of a token's mass e^(l - max) <= 1: a vocabulary's sum fits int64 with room.
MASS_ONE = tl.constexpr(1099511627776.0)  # 2^40
DIGIT_SHIFTS = (24, 16, 8, 0)  # radix select: 8-bit digits of the 32-bit key, most significant first
# The batch size changes every step: Triton must not compile a variant per value of it (it
# specialises integer arguments equal to 1 or divisible by 16 unless told not to).
NO_SPECIALIZE = ["n_rows"]


@triton.jit
def _mass(l, m):
    # A token's fixed-point mass, e^(l - row max) in units of 2^-40 (0 for -inf).
    return (tl.exp(l - m[:, None]) * MASS_ONE).to(tl.int64)


@triton.jit
def _scaled(logits_ptr, row_off, v, mask, temp):
    # l = logits / temperature (temperature 1 for greedy rows); -inf where masked
    # (outside the vocab or a padding row). IEEE division, as in the reference.
    x = tl.load(logits_ptr + row_off[:, None] + v, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.div_rn(x, temp[:, None])


@triton.jit
def _key(l):
    # Monotone map fp32 -> int32: a < b  <=>  key(a) < key(b) (for non-NaN a, b).
    b = l.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _gumbel(seed, group0, BLOCK_V: tl.constexpr):
    # Gumbel noise [rows, BLOCK_V] for BLOCK_V consecutive tokens whose first token is word 0 of
    # Philox counter group0 (per row): token j of the tile takes word j % 4 of the call for
    # counter group0 + j // 4. Philox is the costly part of a draw, so all four words are used.
    g = group0[:, None] + tl.arange(0, BLOCK_V // 4)[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed[:, None], g)
    # join twice -> [rows, BLOCK_V // 4, 2, 2] holding (r0, r1, r2, r3) in row-major order
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [group0.shape[0], BLOCK_V])
    u = tl.uint_to_uniform_float(r)
    return -tl.log(-tl.log(tl.maximum(u, 1e-20)))


@triton.jit
def _row_params(temp_ptr, rows, valid, eps):
    # (greedy, temperature to divide by): greedy rows divide by 1 and take the plain argmax.
    temp = tl.load(temp_ptr + rows, mask=valid, other=1.0)
    greedy = temp < eps
    return greedy, tl.where(greedy, 1.0, temp)


@triton.jit
def _chunk_tile(logits_ptr, temp_ptr, n_rows, vocab, stride_row, eps, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    # The (ROWS x BLOCK_V) tile of program (row block, chunk): rows, greedy flags, token indices,
    # which entries are real tokens, and l there.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = rows < n_rows
    greedy, temp = _row_params(temp_ptr, rows, valid, eps)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    real = valid[:, None] & (v < vocab)
    l = _scaled(logits_ptr, rows.to(tl.int64) * stride_row, v, real, temp)
    return rows, valid, greedy, v, real, l


@triton.jit
def _row_max(chunk_max_ptr, rows, valid, num_chunks, CHUNKS: tl.constexpr):
    c = tl.arange(0, CHUNKS)[None, :]
    parts = tl.load(chunk_max_ptr + rows[:, None] * num_chunks + c, mask=valid[:, None] & (c < num_chunks),
                    other=float("-inf"))
    return tl.where(valid, tl.max(parts, 1), 0.0)  # padding rows: avoid (-inf) - (-inf)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _chunk_max_kernel(logits_ptr, chunk_max_ptr, temp_ptr, n_rows, vocab, stride_row, num_chunks, eps,
                      ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    rows, valid, greedy, v, real, l = _chunk_tile(logits_ptr, temp_ptr, n_rows, vocab, stride_row, eps, ROWS, BLOCK_V)
    tl.store(chunk_max_ptr + rows * num_chunks + tl.program_id(1), tl.max(l, 1), mask=valid)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _radix_count_kernel(logits_ptr, hist_ptr, prefix_ptr, need_ptr, floor_ptr, chunk_max_ptr, temp_ptr,
                        n_rows, vocab, stride_row, num_chunks, eps,
                        SHIFT: tl.constexpr, MASS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                        CHUNKS: tl.constexpr):
    # Adds this chunk's tokens into the row's 256 bins of the key digit at SHIFT, among tokens
    # whose higher digits equal the prefix: a count each (top-k), or the token's fixed-point
    # mass if its key is >= the row's floor (top-p over the top-k survivors).
    rows, valid, greedy, v, real, l = _chunk_tile(logits_ptr, temp_ptr, n_rows, vocab, stride_row, eps, ROWS, BLOCK_V)
    searching = valid & (tl.load(need_ptr + rows, mask=valid, other=0) > 0)
    key = _key(l)
    ukey = key.to(tl.int64) + 2147483648  # in [0, 2^32), same order as key
    prefix = tl.load(prefix_ptr + rows, mask=valid, other=0)
    match = real & searching[:, None] & ((ukey >> (SHIFT + 8)) == prefix[:, None])
    if MASS:
        floor = tl.load(floor_ptr + rows, mask=valid, other=0)
        m = _row_max(chunk_max_ptr, rows, valid, num_chunks, CHUNKS)
        match = match & (key >= floor[:, None])
        weight = _mass(l, m)
    else:
        weight = tl.full(l.shape, 1, tl.int64)
    digit = (ukey >> SHIFT) & 255
    tl.atomic_add(hist_ptr + rows[:, None].to(tl.int64) * 256 + digit, weight, mask=match)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _radix_pick_kernel(hist_ptr, prefix_ptr, need_ptr, n_rows, ROWS: tl.constexpr):
    # The bin where the total from the top first reaches `need`: it extends the prefix by one
    # digit, and `need` drops by what the bins above it hold. Rows with need 0 stay as they are.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = rows < n_rows
    need = tl.load(need_ptr + rows, mask=valid, other=0)
    b = tl.arange(0, 256)[None, :]
    top_down = tl.load(hist_ptr + rows[:, None].to(tl.int64) * 256 + (255 - b), mask=valid[:, None], other=0)
    total = tl.cumsum(top_down, 1)  # total[j]: bins 255 .. 255 - j
    j = tl.min(tl.where(total >= need[:, None], b, 255), 1)  # a searching row always reaches need
    above = tl.sum(tl.where(b == j[:, None], total - top_down, 0), 1)
    prefix = tl.load(prefix_ptr + rows, mask=valid, other=0)
    searching = valid & (need > 0)
    tl.store(prefix_ptr + rows, prefix * 256 + (255 - j), mask=searching)
    tl.store(need_ptr + rows, need - above, mask=searching)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _mass_kernel(logits_ptr, z_ptr, floor_ptr, on_ptr, chunk_max_ptr, temp_ptr, n_rows, vocab, stride_row,
                 num_chunks, eps, ROWS: tl.constexpr, BLOCK_V: tl.constexpr, CHUNKS: tl.constexpr):
    # Z: the fixed-point mass of the row's tokens with key >= floor (the top-k survivors).
    rows, valid, greedy, v, real, l = _chunk_tile(logits_ptr, temp_ptr, n_rows, vocab, stride_row, eps, ROWS, BLOCK_V)
    on = valid & (tl.load(on_ptr + rows, mask=valid, other=0) != 0)
    floor = tl.load(floor_ptr + rows, mask=valid, other=0)
    m = _row_max(chunk_max_ptr, rows, valid, num_chunks, CHUNKS)
    weight = _mass(l, m)
    kept = real & (_key(l) >= floor[:, None])
    tl.atomic_add(z_ptr + rows, tl.sum(tl.where(kept, weight, 0), 1), mask=on)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _chunk_draw_kernel(logits_ptr, chunk_max_ptr, thr_ptr, chunk_best_ptr, chunk_idx_ptr, temp_ptr, min_p_ptr,
                       seed_ptr, offset_ptr, n_rows, vocab, stride_row, num_chunks, eps,
                       ROWS: tl.constexpr, BLOCK_V: tl.constexpr, CHUNKS: tl.constexpr,
                       USE_MIN_P: tl.constexpr, USE_THRESHOLD: tl.constexpr):
    # The chunk's best score (l for greedy rows, l + Gumbel noise otherwise) over kept tokens,
    # and its index (the first on ties).
    rows, valid, greedy, v, real, l = _chunk_tile(logits_ptr, temp_ptr, n_rows, vocab, stride_row, eps, ROWS, BLOCK_V)
    keep = real
    if USE_THRESHOLD:
        thr = tl.load(thr_ptr + rows, mask=valid, other=-2147483648)
        keep = keep & (_key(l) >= thr[:, None])  # greedy rows: INT32_MIN
    if USE_MIN_P:
        m = _row_max(chunk_max_ptr, rows, valid, num_chunks, CHUNKS)
        min_p = tl.where(greedy, 0.0, tl.load(min_p_ptr + rows, mask=valid, other=0.0))
        keep = keep & (tl.exp(l - m[:, None]) >= min_p[:, None])
    seed = tl.load(seed_ptr + rows, mask=valid, other=0)
    group0 = tl.load(offset_ptr + rows, mask=valid, other=0) * tl.cdiv(vocab, 4) + tl.program_id(1) * (BLOCK_V // 4)
    gumbel = _gumbel(seed, group0, BLOCK_V)
    score = tl.where(keep, tl.where(greedy[:, None], l, l + gumbel), float("-inf"))
    at = rows * num_chunks + tl.program_id(1)
    tl.store(chunk_best_ptr + at, tl.max(score, 1), mask=valid)
    tl.store(chunk_idx_ptr + at, tl.argmax(score, 1, tie_break_left=True).to(tl.int64) + tl.program_id(1) * BLOCK_V,
             mask=valid)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _pick_chunk_kernel(chunk_best_ptr, chunk_idx_ptr, out_ptr, n_rows, num_chunks, ROWS: tl.constexpr,
                       CHUNKS: tl.constexpr):
    # The best chunk of each row, the earliest on ties (so the first index overall).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = rows < n_rows
    c = tl.arange(0, CHUNKS)[None, :]
    best = tl.load(chunk_best_ptr + rows[:, None] * num_chunks + c, mask=valid[:, None] & (c < num_chunks),
                   other=float("-inf"))
    winner = tl.argmax(best, 1, tie_break_left=True)
    tl.store(out_ptr + rows, tl.load(chunk_idx_ptr + rows * num_chunks + winner, mask=valid), mask=valid)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _row_sample_kernel(logits_ptr, out_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr,
                       n_rows, vocab, stride_row, eps, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                       USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, USE_MIN_P: tl.constexpr):
    # One program per row block, for batches that fill the GPU by rows alone; every pass streams
    # the row in BLOCK_V chunks. The thresholds are found by bisection on the key over the same
    # integer counts and fixed-point masses as the radix select, so they are the same keys.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = rows < n_rows
    row_off = rows.to(tl.int64) * stride_row
    greedy, temp = _row_params(temp_ptr, rows, valid, eps)
    top_k = tl.load(top_k_ptr + rows, mask=valid, other=0).to(tl.int64)
    top_p = tl.load(top_p_ptr + rows, mask=valid, other=1.0)
    min_p = tl.where(greedy, 0.0, tl.load(min_p_ptr + rows, mask=valid, other=0.0))
    k_on = (top_k > 0) & (top_k < vocab) & ~greedy & valid
    p_on = (top_p < 1.0) & ~greedy & valid
    cols = tl.arange(0, BLOCK_V)[None, :]
    rv = valid[:, None]

    # The USE_* flags say which filters any row of the batch may use (False skips their passes).
    m = tl.zeros([ROWS], tl.float32)
    if USE_TOP_P or USE_MIN_P:  # the row max: for masses and min-p only
        m = tl.full([ROWS], float("-inf"), tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            v = v0 + cols
            m = tl.maximum(m, tl.max(_scaled(logits_ptr, row_off, v, rv & (v < vocab), temp), 1))
        m = tl.where(valid, m, 0.0)  # padding rows: avoid (-inf) - (-inf)

    # Top-k: the largest key t with count(key >= t) >= k. Invariant: the answer is in [lo, hi].
    lo = tl.full([ROWS], -2147483648, tl.int64)
    if USE_TOP_K and tl.max(k_on.to(tl.int32), 0) > 0:
        hi = tl.full([ROWS], 2147483647, tl.int64)
        for _ in range(32):  # the key range is 2^32 wide: 32 halvings leave lo == hi
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
    t = lo

    # Top-p over the top-k survivors: the largest key with mass(key >= t) >= ceil(top_p * Z).
    if USE_TOP_P and tl.max(p_on.to(tl.int32), 0) > 0:
        z = tl.zeros([ROWS], tl.int64)
        for v0 in range(0, vocab, BLOCK_V):
            v = v0 + cols
            l = _scaled(logits_ptr, row_off, v, rv & (v < vocab), temp)
            z += tl.sum(tl.where(_key(l) >= t[:, None], _mass(l, m), 0), 1)
        target = tl.maximum(tl.math.ceil(top_p.to(tl.float64) * z.to(tl.float64)).to(tl.int64), 1)
        lo = t
        hi = tl.full([ROWS], 2147483647, tl.int64)
        for _ in range(32):
            mid = (lo + hi + 1) >> 1
            mass = tl.zeros([ROWS], tl.int64)
            for v0 in range(0, vocab, BLOCK_V):
                v = v0 + cols
                l = _scaled(logits_ptr, row_off, v, rv & (v < vocab), temp)
                mass += tl.sum(tl.where(_key(l) >= mid[:, None], _mass(l, m), 0), 1)
            ok = mass >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        t = tl.where(p_on, lo, t)

    seed = tl.load(seed_ptr + rows, mask=valid, other=0)
    group0 = tl.load(offset_ptr + rows, mask=valid, other=0) * tl.cdiv(vocab, 4)  # Philox counter of token 0
    best = tl.full([ROWS], float("-inf"), tl.float32)
    best_idx = tl.zeros([ROWS], tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + cols
        l = _scaled(logits_ptr, row_off, v, rv & (v < vocab), temp)
        keep = rv & (v < vocab)
        if USE_TOP_K or USE_TOP_P:
            keep = keep & (_key(l) >= t[:, None])
        if USE_MIN_P:
            keep = keep & (tl.exp(l - m[:, None]) >= min_p[:, None])
        gumbel = _gumbel(seed, group0 + v0 // 4, BLOCK_V)
        score = tl.where(keep, tl.where(greedy[:, None], l, l + gumbel), float("-inf"))
        blk_best = tl.max(score, 1)
        blk_idx = tl.argmax(score, 1, tie_break_left=True).to(tl.int64) + v0
        better = blk_best > best  # strict: the earlier index wins ties
        best = tl.where(better, blk_best, best)
        best_idx = tl.where(better, blk_idx, best_idx)
    tl.store(out_ptr + rows, best_idx, mask=valid)


class _Launch:
    """The shapes of one sampling call: rows per program (a constant per platform, never a
    function of the batch: batch invariance), chunk width and count."""

    def __init__(self, logits: torch.Tensor):
        self.n, self.vocab = logits.shape
        self.rows = 32 if interpret_mode() else 1  # the interpreter pays per program, a GPU per row
        self.block_v = 256 if interpret_mode() else 4096  # several chunks even at test sizes
        self.num_chunks = triton.cdiv(self.vocab, self.block_v)
        self.chunks_p2 = triton.next_power_of_2(self.num_chunks)
        self.grid = (triton.cdiv(self.n, self.rows), self.num_chunks)
        self.row_grid = (triton.cdiv(self.n, self.rows),)


def _radix_select(launch: _Launch, logits, temperature, need, floor, chunk_max, mass: bool) -> torch.Tensor:
    """Per row, the largest key t with count (mass=False) or fixed-point mass (mass=True, only
    keys >= floor) of keys >= t reaching `need`; rows with need 0 get INT32_MIN."""
    n, dev = launch.n, logits.device
    prefix = torch.zeros(n, dtype=torch.int64, device=dev)
    searching = need > 0
    need = need.clone()
    hist = torch.zeros(len(DIGIT_SHIFTS), n, 256, dtype=torch.int64, device=dev)
    for round_, shift in enumerate(DIGIT_SHIFTS):
        _radix_count_kernel[launch.grid](
            logits, hist[round_], prefix, need, floor, chunk_max, temperature,
            n, launch.vocab, logits.stride(0), launch.num_chunks, SAMPLING_EPS,
            SHIFT=shift, MASS=mass, ROWS=launch.rows, BLOCK_V=launch.block_v, CHUNKS=launch.chunks_p2, num_warps=8)
        _radix_pick_kernel[launch.row_grid](hist[round_], prefix, need, n, ROWS=launch.rows, num_warps=4)
    return torch.where(searching, prefix + INT32_MIN, INT32_MIN)


def _thresholds(launch: _Launch, logits, temperature, top_k, top_p, chunk_max, any_top_k: bool,
                any_top_p: bool) -> torch.Tensor:
    """Each row's key threshold: top-k's, raised by top-p's; INT32_MIN where neither applies."""
    vocab, dev = launch.vocab, logits.device
    sampled = temperature >= SAMPLING_EPS
    k_on = sampled & (top_k > 0) & (top_k < vocab)
    p_on = sampled & (top_p < 1.0)
    t_k = torch.full((launch.n,), INT32_MIN, dtype=torch.int64, device=dev)
    if any_top_k:
        t_k = _radix_select(launch, logits, temperature, torch.where(k_on, top_k, 0), t_k, chunk_max, mass=False)
    if not any_top_p:
        return t_k
    z = torch.zeros(launch.n, dtype=torch.int64, device=dev)
    _mass_kernel[launch.grid](logits, z, t_k, p_on.to(torch.int32), chunk_max, temperature, launch.n, vocab,
                              logits.stride(0), launch.num_chunks, SAMPLING_EPS, ROWS=launch.rows,
                              BLOCK_V=launch.block_v, CHUNKS=launch.chunks_p2, num_warps=8)
    # mass >= top_p * Z  <=>  mass >= ceil(top_p * Z) for an integer mass; at least one token.
    target = torch.ceil(top_p.double() * z.double()).long().clamp(min=1)
    t_p = _radix_select(launch, logits, temperature, torch.where(p_on, target, 0), t_k, chunk_max, mass=True)
    return torch.where(p_on, t_p, t_k)


def sample_tokens_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets, *,
                         any_top_k: bool = True, any_top_p: bool = True, any_min_p: bool = True):
    """The flags say what the caller knows of the rows without reading the device: a False one
    (no row filters by top-k, top-p or min-p) skips that filter's passes. They are upper bounds:
    True is always correct."""
    n, vocab = logits.shape
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(-1) == 1
    dev = logits.device
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    temperature = temperature.to(device=dev, dtype=torch.float32).contiguous()
    min_p = min_p.to(device=dev, dtype=torch.float32).contiguous()
    seeds = seeds.to(device=dev, dtype=torch.int64).contiguous()
    offsets = offsets.to(device=dev, dtype=torch.int64).contiguous()
    launch = _Launch(logits)
    top_k = top_k.to(device=dev, dtype=torch.int64).contiguous()
    top_p = top_p.to(device=dev, dtype=torch.float32).contiguous()
    if not interpret_mode() and n >= num_sms(dev):
        # Enough rows to fill the GPU one row per program: no partials, no atomics.
        return _sample_per_row(launch, logits, temperature, top_k, top_p, min_p, seeds, offsets, out,
                               any_top_k=any_top_k, any_top_p=any_top_p, any_min_p=any_min_p)
    chunk_max = torch.empty(n, launch.num_chunks, dtype=torch.float32, device=dev)
    if any_top_p or any_min_p:
        _chunk_max_kernel[launch.grid](logits, chunk_max, temperature, n, vocab, logits.stride(0), launch.num_chunks,
                                       SAMPLING_EPS, ROWS=launch.rows, BLOCK_V=launch.block_v, num_warps=8)
    thresholds = None
    if any_top_k or any_top_p:
        thresholds = _thresholds(launch, logits, temperature, top_k, top_p, chunk_max, any_top_k, any_top_p)
    chunk_best = torch.empty(n, launch.num_chunks, dtype=torch.float32, device=dev)
    chunk_idx = torch.empty(n, launch.num_chunks, dtype=torch.int64, device=dev)
    _chunk_draw_kernel[launch.grid](
        logits, chunk_max, thresholds if thresholds is not None else chunk_idx, chunk_best, chunk_idx, temperature,
        min_p, seeds, offsets, n, vocab, logits.stride(0), launch.num_chunks, SAMPLING_EPS,
        ROWS=launch.rows, BLOCK_V=launch.block_v, CHUNKS=launch.chunks_p2, USE_MIN_P=any_min_p,
        USE_THRESHOLD=thresholds is not None, num_warps=8)
    _pick_chunk_kernel[launch.row_grid](chunk_best, chunk_idx, out, n, launch.num_chunks, ROWS=launch.rows,
                                        CHUNKS=launch.chunks_p2, num_warps=1)
    return out


def _sample_per_row(launch: _Launch, logits, temperature, top_k, top_p, min_p, seeds, offsets, out, *,
                    any_top_k: bool = True, any_top_p: bool = True, any_min_p: bool = True) -> torch.Tensor:
    """One program per row (`_row_sample_kernel`); inputs already on the device."""
    _row_sample_kernel[launch.row_grid](logits, out, temperature, top_k, top_p, min_p, seeds, offsets, launch.n,
                                        launch.vocab, logits.stride(0), SAMPLING_EPS, ROWS=launch.rows,
                                        BLOCK_V=min(max(triton.next_power_of_2(launch.vocab), 4), 4096),
                                        USE_TOP_K=any_top_k, USE_TOP_P=any_top_p, USE_MIN_P=any_min_p, num_warps=8)
    return out


def sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> torch.Tensor:
    """logits fp32 [n, vocab] (the Triton path also reads bf16/fp16, widened exactly); per-row
    temperature, top_k (0 or >= vocab: off), top_p (1: off), min_p (0: off), seeds int64,
    offsets int64 (e.g. the request's output position).
    Returns int64 [n] token ids on logits' device. Draws depend only on (seed, offset)."""
    if use_triton(logits):
        return sample_tokens_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return reference.sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets)
