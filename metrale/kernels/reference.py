"""PyTorch references for every kernel in metrale.kernels.

These are the ground truth the Triton kernels are tested against, and the
fallback when Triton cannot run (CPU without TRITON_INTERPRET). They favour
clarity over speed: plain loops over sequences, math in fp32.

Layout (shared with the kernels, see docs/kernels.md):
  k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  slot s            -> block s // block_size, offset s % block_size
  block_tables      int32 [num_seqs, max_blocks_per_seq]
  cu_seqlens_q      int32 [num_seqs + 1]
  seq_lens          int32 [num_seqs], context length INCLUDING the new tokens
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Temperatures below this are treated as 0 (greedy); avoids overflowing logits / T.
SAMPLING_EPS = 1e-5


# --------------------------------------------------------------------------- KV cache


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k_cache[slot] = k[token] for every token whose slot is not -1 (in place)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[valid].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[valid].to(v_cache.dtype)


def gather_kv(cache, block_table_row, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one sequence from a paged cache: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table_row.long()[pos // block_size]
    return cache[blocks, pos % block_size]


# --------------------------------------------------------------------------- attention


def extend_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_q_len, scale):
    """Causal attention of the new tokens of each sequence over its paged context.

    q: [num_tokens, num_heads, head_dim]; query token j of sequence i sits at
    absolute position seq_lens[i] - q_len_i + j and sees cache positions 0..that.
    `max_q_len` is unused here (kept for signature parity with the kernel).
    """
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], ctx).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[i], ctx).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = ctx - q_len + torch.arange(q_len, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_kv_splits=None):
    """One query token per sequence (the last position). q: [num_seqs, num_heads, head_dim]."""
    num_seqs = q.shape[0]
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
    return extend_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, 1, scale)


# --------------------------------------------------------------------------- norms


def rms_norm(x, weight, eps):
    """HF LlamaRMSNorm: weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype).

    The output is cast to x.dtype (HF would promote to weight's dtype if it differed).
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    """new_residual = x + residual (in the model dtype, as HF does); normed = rms_norm(new_residual)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


# --------------------------------------------------------------------------- rotary


def apply_rotary(positions, q, k, cos_sin_cache, rotary_dim, is_neox):
    """Rotary embedding on the first rotary_dim dims of every head; returns NEW tensors.

    cos_sin_cache[pos] = [cos(pos * f_0..f_{r/2-1}), sin(...)] (fp32).
    neox: pairs (x[i], x[i + r/2]);  GPT-J: pairs (x[2i], x[2i + 1]).
    """
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, r/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        xr = x[..., :rotary_dim].float()
        if is_neox:
            x1, x2 = xr.chunk(2, dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        rotated = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
        out = x.clone()
        out[..., :rotary_dim] = rotated.to(x.dtype)
        return out

    return rotate(q), rotate(k)


# --------------------------------------------------------------------------- activation


def silu_and_mul(x):
    """silu(x[..., :d]) * x[..., d:], with HF's rounding (silu result cast to dtype first)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# --------------------------------------------------------------------------- sampling


def filter_logits(logits, temperature, top_k, top_p, min_p):
    """The sampling distribution of each row: fp32 probabilities [n, vocab].

    Semantics (the Triton sampler implements the same sets):
      * temperature < SAMPLING_EPS: greedy, all mass on the first argmax of the raw logits.
      * otherwise l = logits / temperature, then, in this order:
      * top-k (0 < k < vocab, else off): keep tokens with l >= the k-th largest l
        (ties at the threshold are all kept, so more than k may survive).
      * top-p (< 1, else off), on the softmax of the top-k survivors: keep token i
        iff the mass of tokens with STRICTLY larger l is < top_p (the token that
        crosses top_p is kept; tied tokens are kept or dropped together; the
        argmax is always kept).
      * min-p (> 0, else off): keep p_i >= min_p * p_max, i.e. exp(l_i - max l) >= min_p.
      * renormalise the survivors.
    """
    logits = logits.float()
    n, vocab = logits.shape
    greedy = temperature < SAMPLING_EPS
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    l = logits / temp[:, None]
    keep = torch.ones_like(l, dtype=torch.bool)

    k = top_k.long()
    k_on = (k > 0) & (k < vocab)
    if k_on.any():
        sorted_l = l.sort(dim=-1, descending=True).values
        kth = sorted_l.gather(1, (k.clamp(1, vocab) - 1)[:, None])
        keep &= ~k_on[:, None] | (l >= kth)

    masked = l.masked_fill(~keep, float("-inf"))
    m = masked.max(dim=-1, keepdim=True).values
    p_on = top_p < 1
    if p_on.any():
        probs = torch.softmax(masked, dim=-1)
        sorted_l, order = masked.sort(dim=-1, descending=True)
        sorted_p = probs.gather(1, order)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # exclusive cumsum
        # mass strictly above token i = exclusive cumsum at the FIRST sorted entry equal to l_i
        first = torch.searchsorted(-sorted_l, -masked, side="left").clamp(max=vocab - 1)
        above = mass_before.gather(1, first)
        keep &= ~p_on[:, None] | (above < top_p[:, None]) | (masked == m)

    min_p_on = min_p > 0
    if min_p_on.any():
        keep &= ~min_p_on[:, None] | (torch.exp(l - m) >= min_p[:, None])

    probs = torch.softmax(l.masked_fill(~keep, float("-inf")), dim=-1)
    one_hot = F.one_hot(logits.argmax(dim=-1), vocab).float()
    return torch.where(greedy[:, None], one_hot, probs)


def sample_tokens(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """Draw one token per row from filter_logits(...). Row i's draw uses a torch.Generator
    seeded from (seeds[i], offsets[i]) only, so it is deterministic and batch-invariant
    (but not bit-equal to the Triton sampler's Philox draws)."""
    probs = filter_logits(logits, temperature, top_k, top_p, min_p).cpu()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for i, (seed, off) in enumerate(zip(seeds.tolist(), offsets.tolist())):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + off) % (2**63))
        out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return out.to(logits.device)


# --------------------------------------------------------------------------- per-head q/k norm + rotary


def qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, rotary_dim, is_neox):
    """Qwen3's per-head RMSNorm of q and k (over head_dim), then rotary; returns NEW tensors.

    The composition of the two references above: the norm output is rounded to the model
    dtype before it is rotated, as in the unfused path.
    """
    return apply_rotary(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos_sin_cache,
                        rotary_dim, is_neox)


# --------------------------------------------------------------------------- token bitmask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[i], v] = -inf where bit v % 32 of bitmask[i, v // 32] is 0 (in place).
    bitmask: int32 [len(rows), ceil(vocab / 32)], bit j of word w is token 32 * w + j (xgrammar's
    layout); tokens past the bitmask's width are masked too."""
    vocab = logits.shape[1]
    tokens = torch.arange(vocab, device=logits.device)
    words = bitmask.long()[:, (tokens // 32).clamp(max=bitmask.shape[1] - 1)]
    allowed = ((words >> (tokens % 32)) & 1).bool() & (tokens < bitmask.shape[1] * 32)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def fill_step_inputs(input_ids, positions, slots, seq_lens, tables, block_size: int, tokens=None, token_holes=None,
                     token_sources=None, drafts=None, draft_holes=None, draft_sources=None, accepted=None,
                     moved_seqs=None, moved_unverified=None, moved_last_rows=None, moved_rows=None,
                     moved_row_seqs=None) -> None:
    """kernels/step_inputs.py's rule: a step's inputs completed in place from the step before."""
    if token_holes is not None:
        input_ids[token_holes] = tokens[token_sources]
    if draft_holes is not None:
        input_ids[draft_holes] = drafts.reshape(-1)[draft_sources].clamp(min=0)
    if moved_seqs is None:
        return
    delta = accepted[moved_last_rows] - moved_unverified
    position = positions[moved_rows] + delta[moved_row_seqs]
    positions[moved_rows] = position
    seq_lens[moved_seqs] += delta.to(seq_lens.dtype)
    blocks = tables[moved_seqs[moved_row_seqs], position // block_size].long()
    slots[moved_rows] = blocks * block_size + position % block_size
