"""The rejection sampler of speculative decoding in Triton (executor/rejection_sampler.py holds the
rule and the PyTorch reference this kernel is tested against).

Input: one score row per verified position, R rows in all, request i's 1 + k_i rows from
row_start[i]: its last token's position, then one per draft. A greedy request's rows are its
logits (after penalties); a sampled request's are its filtered logits (penalties, temperature,
top-k / top-p / min-p as -inf), computed by the sampler's own code per position.

Two launches, shapes and host ints only (CUDA-graph safe, no host sync):

1. `_chunk_stats_kernel`, grid (R, vocab chunks): per chunk of a row, its maximum and first
   argmax (greedy), its sum of exp(score - max), and the winner of the exponential race for
   the token drawn there: argmax over v of score_v - log(E_v), E_v = -log(u_v) (a draw from
   softmax(score)), the row's draft excluded (the residual of a point-mass draft, p with d
   removed); the bonus row excludes nothing.
2. `_accept_kernel`, grid (requests,): merges each row's chunks and walks the drafts in order:
   greedy accepts draft j while it is row j's argmax; sampled accepts it when u_j < p_j(d_j).
   The token after the accepted drafts is the argmax (greedy) or the race's winner (sampled) at
   the first rejected row, or at the bonus row when all are accepted.

Random numbers are counter-based, the same function here and in the reference
(`counter_uniforms`): a 64-bit key per (request seed, output index) from splitmix64 (host side,
sampler.stream_seed) and a 32-bit mixing hash of (key, element): the accept test's uniform is
element 0 of the accept stream's key, the race's noise of vocabulary entry v is element v of the
draw stream's key. So the kernel and the reference draw the same numbers; their tokens can differ
only where floating-point rounding of a softmax sum or a logarithm decides (near-exact ties).
"""

from __future__ import annotations

import torch

from metrale.kernels import tl, triton

_MASK32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B  # lowbias32 (a bijective 32-bit integer mixer)

BLOCK_V = 2048  # vocabulary entries per chunk program


# --------------------------------------------------------------------------- the random streams


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """_mix32 of one Python int (a uint32): the same arithmetic, without a tensor per operation."""
    x ^= x >> 16
    x = (x * _MUL1) & _MASK32
    x ^= x >> 15
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def counter_uniforms_rows(keys: list[int], elements: torch.Tensor) -> torch.Tensor:
    """[len(keys), len(elements)]: row i is `counter_uniforms(keys[i], elements)`, in one pass."""
    bases = [_mix32_int((key & _MASK32) ^ _mix32_int((key >> 32) & _MASK32)) for key in keys]
    h = _mix32(torch.tensor(bases, dtype=torch.int64, device=elements.device)[:, None] ^ elements[None, :])
    return ((h >> 9) * 2 + 1).to(torch.float32) * (1.0 / (1 << 24))


def counter_uniforms(key: int, elements: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1), one per element (int64 tensor of values < 2^32), of the stream
    `key` (a 64-bit int): (2 * (h >> 9) + 1) / 2^24 for h = hash(key, element), exact in fp32."""
    return counter_uniforms_rows([key], elements)[0]


@triton.jit
def _mul32_tl(x, c: tl.constexpr):
    # _mul32 in int64, op for op: the same values under the interpreter and compiled.
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32_tl(x):
    x = x ^ (x >> 16)
    x = _mul32_tl(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32_tl(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _uniforms_tl(key, elements):
    # counter_uniforms of the int64 `key`: int64 values below 2^32 throughout, as in the reference.
    lo = key & 0xFFFFFFFF
    hi = (key >> 32) & 0xFFFFFFFF
    h = _mix32_tl(_mix32_tl(lo ^ _mix32_tl(hi)) ^ elements.to(tl.int64))
    return ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)


# --------------------------------------------------------------------------- the kernels


@triton.jit
def _chunk_stats_kernel(scores_ptr, row_draft_ptr, draw_key_ptr, cmax_ptr, csum_ptr, cargmax_ptr, race_val_ptr,
                        race_idx_ptr, vocab, stride_row, num_chunks, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = v < vocab
    s = tl.load(scores_ptr + row.to(tl.int64) * stride_row + v, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(s - m_safe), 0)
    arg = tl.argmax(s, 0, tie_break_left=True)
    draft = tl.load(row_draft_ptr + row)
    noise = -tl.log(_uniforms_tl(tl.load(draw_key_ptr + row), v))  # exponential, > 0
    race = tl.where((s == float("-inf")) | (v == draft), float("-inf"), s - tl.log(noise))
    race_arg = tl.argmax(race, 0, tie_break_left=True)
    out = row * num_chunks + chunk
    tl.store(cmax_ptr + out, m)
    tl.store(csum_ptr + out, total)
    tl.store(cargmax_ptr + out, chunk * BLOCK_V + arg)
    tl.store(race_val_ptr + out, tl.max(race, 0))
    tl.store(race_idx_ptr + out, chunk * BLOCK_V + race_arg)


@triton.jit
def _row_merge(cmax_ptr, csum_ptr, cargmax_ptr, race_val_ptr, race_idx_ptr, row, num_chunks, valid,
               BLOCK_C: tl.constexpr):
    # (max score, sum of exp(score - max), greedy token, race winner) of one row from its chunks;
    # ties go to the lowest vocabulary index, as within a chunk.
    c = tl.arange(0, BLOCK_C)
    mask = (c < num_chunks) & (c * 0 + valid.to(tl.int32) > 0)  # (the interpreter broadcasts no scalar mask)
    at = row * num_chunks + c
    cmax = tl.load(cmax_ptr + at, mask=mask, other=float("-inf"))
    csum = tl.load(csum_ptr + at, mask=mask, other=0.0)
    m = tl.max(cmax, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.where(cmax == float("-inf"), 0.0, csum * tl.exp(cmax - m_safe)), 0)
    greedy = tl.load(cargmax_ptr + row * num_chunks + tl.argmax(cmax, 0, tie_break_left=True), mask=valid, other=0)
    race = tl.load(race_val_ptr + at, mask=mask, other=float("-inf"))
    winner = tl.load(race_idx_ptr + row * num_chunks + tl.argmax(race, 0, tie_break_left=True), mask=valid, other=0)
    return m_safe, total, greedy, winner


@triton.jit
def _accept_kernel(scores_ptr, row_start_ptr, num_drafts_ptr, drafts_ptr, greedy_ptr, accept_key_ptr,
                   cmax_ptr, csum_ptr, cargmax_ptr, race_val_ptr, race_idx_ptr, num_accepted_ptr, tokens_ptr,
                   stride_row, stride_drafts, num_chunks, BLOCK_C: tl.constexpr):
    # The walk over a request's 1 + k rows is a loop bounded at run time: one variant for every k.
    req = tl.program_id(0)
    start = tl.load(row_start_ptr + req)
    k = tl.load(num_drafts_ptr + req)
    greedy = tl.load(greedy_ptr + req) != 0
    accepted = k * 0
    token = (k * 0).to(tl.int64)
    alive = k >= 0  # still accepting
    for j in range(0, k + 1):
        valid = k >= j
        row = start + j
        m, total, argmax, winner = _row_merge(cmax_ptr, csum_ptr, cargmax_ptr, race_val_ptr, race_idx_ptr,
                                              row, num_chunks, valid, BLOCK_C)
        is_draft = k > j
        draft = tl.load(drafts_ptr + req * stride_drafts + j, mask=is_draft, other=-1)
        score_d = tl.load(scores_ptr + row.to(tl.int64) * stride_row + draft, mask=is_draft & (draft >= 0),
                          other=float("-inf")).to(tl.float32)
        p_draft = tl.exp(score_d - m) / tl.maximum(total, 1e-30)
        u = _uniforms_tl(tl.load(accept_key_ptr + row, mask=valid, other=0), row * 0)  # the accept stream's element 0
        ok = is_draft & tl.where(greedy, argmax == draft, u < p_draft)
        stop_here = alive & valid & ~ok
        token = tl.where(stop_here, tl.where(greedy, argmax, winner).to(tl.int64), token)
        accepted = tl.where(alive & ok, accepted + 1, accepted)
        alive = alive & ok
    tl.store(num_accepted_ptr + req, accepted.to(tl.int64))
    tl.store(tokens_ptr + req, token)


def rejection_sample_triton(scores: torch.Tensor, row_start: torch.Tensor, num_drafts: torch.Tensor,
                            drafts: torch.Tensor, greedy: torch.Tensor, draw_keys: torch.Tensor,
                            accept_keys: torch.Tensor, row_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, vocab] (fp32, or the logits' dtype when every request is greedy); per request
    (int32 [B]): row_start, num_drafts, greedy (1 / 0); drafts int32 [B, max_drafts] (-1 past
    num_drafts); per row (int64 [R]): draw_keys and accept_keys (64-bit stream keys as int64 bit
    patterns), and row_draft int32 [R] (the draft verified at that row, -1 at a bonus row).
    Returns (accepted drafts, the token after them), int64 [B] each."""
    rows, vocab = scores.shape
    assert scores.stride(-1) == 1 and drafts.is_contiguous()
    num_requests, max_drafts = drafts.shape
    num_chunks = triton.cdiv(vocab, BLOCK_V)
    stats = [torch.empty(rows * num_chunks, dtype=dtype, device=scores.device)
             for dtype in (torch.float32, torch.float32, torch.int32, torch.float32, torch.int32)]
    _chunk_stats_kernel[(rows, num_chunks)](scores, row_draft, draw_keys, *stats, vocab, scores.stride(0), num_chunks,
                                             BLOCK_V=BLOCK_V, num_warps=8)
    num_accepted = torch.empty(num_requests, dtype=torch.int64, device=scores.device)
    tokens = torch.empty(num_requests, dtype=torch.int64, device=scores.device)
    _accept_kernel[(num_requests,)](scores, row_start, num_drafts, drafts, greedy, accept_keys, *stats, num_accepted,
                                    tokens, scores.stride(0), max(max_drafts, 1), num_chunks,
                                    BLOCK_C=max(16, triton.next_power_of_2(num_chunks)),
                                    num_warps=1)
    return num_accepted, tokens
