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


def sample_tokens_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    n, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    dev = logits.device
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
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
