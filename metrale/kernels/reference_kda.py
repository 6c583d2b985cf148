"""PyTorch references for Kimi Delta Attention (KDA, the linear attention of Kimi Linear and
GLM-5.3): the delta rule with a per-channel decay, over a flattened batch of sequences whose
per-request state lives in a slot pool, and the forget gate that makes that decay.

KDA is Gated DeltaNet with the decay per key channel instead of per head: the state of head h
is S_h [key_dim, value_dim], and for each token

    S <- diag(exp(g_t)) S                  g_t [key_dim] <= 0, the log decay of every key channel
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (q_t / sqrt(key_dim))

with q and k L2-normalised. The math and its order follow transformers' own torch fallbacks
(`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention` in modeling_glm5_next.py), so a
float32 run matches the reference; the chunked form solves its triangular system with
`solve_triangular` where transformers substitutes row by row (the same system).

The conv in front of it is Gated DeltaNet's (reference_linear_attention.causal_conv1d / _step).

Layout (as reference_linear_attention.py, but one head count and a per-channel g):
  q, k, v           [num_tokens, heads, head_dim]
  g                 [num_tokens, heads, head_dim]    float32 log decay (<= 0)
  beta              [num_tokens, heads]             write strength
  recurrent_state   [num_slots, heads, head_dim, head_dim]
  query_start_loc, state_slots, has_initial_state  as reference_linear_attention.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels.reference_linear_attention import l2norm, recurrent_keeping_drafts


def kda_forget_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    lower_bound: float | None) -> torch.Tensor:
    """The per-channel log decay from the gate projection f [T, heads, head_dim], A_log [heads]
    and dt_bias [heads * head_dim], in float32: with a lower bound b (GLM-5.3's "safe gate"),
    b * sigmoid(exp(A_log) * (f + dt_bias)), in [b, 0]; without, -exp(A_log) * softplus(f +
    dt_bias) (softplus taken as the identity above 20, as transformers does)."""
    g = f.float() + dt_bias.float().view(1, *f.shape[1:])
    rate = A_log.float().exp().view(1, -1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


def _chunked_one(q, k, v, g, beta, state, chunk_size: int):
    """One sequence by the chunked algorithm. q, k, v, g [H, L, D] float32 (q, k normalised);
    beta [H, L]; state [H, D, Dv]. Returns (out [H, L, Dv], final state). The pairwise decays
    [H, C, C, D] are built one chunk at a time: for all chunks at once they would take
    length x chunk x head_dim floats per head (16 GiB for 64 heads of 128 over 8k tokens)."""
    heads, length, dim = k.shape
    pad = (chunk_size - length % chunk_size) % chunk_size
    q = F.pad(q, (0, 0, 0, pad)) * dim ** -0.5
    k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (k, v, g))
    beta = F.pad(beta, (0, pad))
    chunks = (length + pad) // chunk_size
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, g, k_beta, v_beta = (t.reshape(heads, chunks, chunk_size, t.shape[-1]) for t in (q, k, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)  # within each chunk: the log decay from its start, per channel
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    out = torch.zeros_like(v_beta)
    for i in range(chunks):
        q_i, k_i, g_i, kb_i, g_last = q[:, i], k[:, i], g[:, i], k_beta[:, i], g[:, i, -1:]
        # decay[r, c, d] = exp(g_r[d] - g_c[d]) for c <= r, 0 above the diagonal: [H, C, C, D]
        decay = (g_i.unsqueeze(-2) - g_i.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
        system = (kb_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay).sum(dim=-1)  # strictly lower part used
        new_values = torch.linalg.solve_triangular(system, v_beta[:, i], upper=False, unitriangular=True)
        k_cumdecay = torch.linalg.solve_triangular(system, kb_i * g_i.exp(), upper=False, unitriangular=True)
        intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(upper, 0)
        v_new = new_values - k_cumdecay @ state
        out[:, i] = (q_i * g_i.exp()) @ state + intra @ v_new
        state = state * g_last.exp().transpose(-1, -2) + (k_i * (g_last - g_i).exp()).transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :length], state


def _recurrent_one(q, k, v, g, beta, state):
    """The same sequence token by token (the decode step's algorithm); shapes as _chunked_one."""
    q = q * k.shape[-1] ** -0.5
    out = torch.zeros_like(v)
    for t in range(k.shape[1]):
        state = state * g[:, t].exp().unsqueeze(-1)
        memory = (state * k[:, t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, t] - memory) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = (state * q[:, t].unsqueeze(-1)).sum(dim=-2)
    return out, state


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[length, heads, ...] -> [heads, length, ...] in float32."""
    return x.transpose(0, 1).to(torch.float32).contiguous()


def kimi_delta_rule(q, k, v, g, beta, recurrent_state, query_start_loc, state_slots, has_initial_state,
                    chunk_size: int = 64, draft_rows: list[list[int]] | None = None) -> torch.Tensor:
    """KDA over each sequence (q, k L2-normalised here). A one-token step of a sequence with
    state takes the recurrent form, every other the chunked form (as transformers does). Returns
    [num_tokens, heads, head_dim] in v's dtype; each sequence's final state goes to its slot.
    `draft_rows`: a verify step's scratch rows, as reference_linear_attention.gated_delta_rule."""
    out = torch.empty_like(v)
    starts = query_start_loc.tolist()
    for i, (slot, has_state) in enumerate(zip(state_slots.tolist(), has_initial_state.tolist())):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        qi, ki = (l2norm(_heads_first(t[start:end])) for t in (q, k))
        vi, gi, bi = _heads_first(v[start:end]), _heads_first(g[start:end]), _heads_first(beta[start:end])
        shape = (v.shape[1], k.shape[2], v.shape[2])
        state = recurrent_state[slot].to(torch.float32) if has_state else vi.new_zeros(shape)
        if draft_rows is not None and draft_rows[i]:
            o, state = recurrent_keeping_drafts(_recurrent_one, qi, ki, vi, gi, bi, state, recurrent_state,
                                                draft_rows[i])
        elif has_state and end - start == 1:
            o, state = _recurrent_one(qi, ki, vi, gi, bi, state)
        else:
            o, state = _chunked_one(qi, ki, vi, gi, bi, state, chunk_size)
        out[start:end] = o.transpose(0, 1).to(v.dtype)
        recurrent_state[slot] = state.to(recurrent_state.dtype)
    return out


def kimi_delta_rule_step(q, k, v, g, beta, recurrent_state, state_slots) -> torch.Tensor:
    """One token per sequence, every sequence with state (decode), all at once: q, k, v, g
    [num_seqs, heads, head_dim], beta [num_seqs, heads]."""
    slots = state_slots.long()
    q, k = (l2norm(t.to(torch.float32)) for t in (q, k))
    q = q * k.shape[-1] ** -0.5
    state = recurrent_state[slots].to(torch.float32) * g.to(torch.float32).exp().unsqueeze(-1)
    memory = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v.to(torch.float32) - memory) * beta.to(torch.float32).unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    recurrent_state[slots] = state.to(recurrent_state.dtype)
    return (state * q.unsqueeze(-1)).sum(dim=-2).to(v.dtype)
