"""PyTorch references for the Gated DeltaNet (linear attention) kernels: the causal depthwise
conv1d in front of the delta rule, and the gated delta rule itself, over a flattened batch of
sequences whose per-request state lives in a slot pool.

The math and its order of operations follow transformers' own torch fallbacks
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`,
`causal_conv1d_update` in modeling_qwen3_next.py), so a float32 run matches the reference
model token for token. They are the CPU path and the ground truth of the Triton kernels.

Layout (shared with the kernels, see docs/kernels.md):
  x                 [num_tokens, channels]          conv input, sequences back to back
  q, k              [num_tokens, key_heads, key_dim]
  v                 [num_tokens, value_heads, value_dim]   (value_heads a multiple of key_heads)
  g, beta           [num_tokens, value_heads]       log decay (<= 0) and write strength
  conv_state        [num_slots, channels, kernel - 1]      the last kernel-1 inputs of a request
  recurrent_state   [num_slots, value_heads, key_dim, value_dim]
  query_start_loc   int32 [num_seqs + 1]            sequence i owns rows [qsl[i], qsl[i+1])
  state_slots       int32 [num_seqs]                the slot holding sequence i's state
  has_initial_state bool  [num_seqs]                False: the sequence starts here (state zero,
                                                    whatever the slot holds)
Every function reads a sequence's state from its slot and writes the state after its last
token back there. In a verify step (speculative decoding) the delta rule also keeps a drafted
sequence's state after each draft in scratch slots (`draft_rows`, layers/linear_attention/
draft_states.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# --------------------------------------------------------------------------- causal conv1d


def causal_conv1d(x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state,
                  silu: bool = True) -> torch.Tensor:
    """Depthwise causal conv over each sequence, preceded by its saved inputs (zeros for a
    fresh sequence); weight [channels, kernel]. Returns [num_tokens, channels] in x's dtype."""
    out = torch.empty_like(x)
    width = weight.shape[1] - 1
    starts = query_start_loc.tolist()
    for i, (slot, has_state) in enumerate(zip(state_slots.tolist(), has_initial_state.tolist())):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        seq = x[start:end].t().to(weight.dtype)  # [channels, length]
        if has_state:
            padded = torch.cat([conv_state[slot].to(weight.dtype), seq], dim=1)
            y = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), bias, groups=seq.shape[0])[0]
        else:  # zero history: the reference's own zero padding (the same sums, the same order)
            padded = F.pad(seq, (width, 0))
            y = F.conv1d(seq.unsqueeze(0), weight.unsqueeze(1), bias, padding=width, groups=seq.shape[0])[0, :, :-width]
        if silu:
            y = F.silu(y)
        out[start:end] = y.t().to(x.dtype)
        conv_state[slot] = padded[:, -width:].to(conv_state.dtype)
    return out


def causal_conv1d_step(x, weight, bias, conv_state, state_slots, silu: bool = True) -> torch.Tensor:
    """One new token per sequence (decode): x [num_seqs, channels]; every sequence has state."""
    slots = state_slots.long()
    window = torch.cat([conv_state[slots].to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)
    y = F.conv1d(window, weight.unsqueeze(1), bias, groups=window.shape[1])[..., -1]
    if silu:
        y = F.silu(y)
    conv_state[slots] = window[..., 1:].to(conv_state.dtype)
    return y.to(x.dtype)


# --------------------------------------------------------------------------- gating


def gdn_gating(a, b, A, dt_bias):
    """The layer's gates from its a, b projections ([num_tokens, value_heads]), A = -exp(A_log)
    in float32 and dt_bias ([value_heads]), as transformers computes them: g = A * softplus(a +
    dt_bias) in float32 (the log decay), beta = sigmoid(b) in b's dtype."""
    return A * F.softplus(a.float() + dt_bias), b.sigmoid()


# --------------------------------------------------------------------------- gated delta rule


def _heads_first(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """[length, heads, dim] -> [heads * repeat, length, dim] in float32 (key heads repeated for
    the value heads they serve)."""
    if repeat > 1:
        x = x.repeat_interleave(repeat, dim=1)
    return x.transpose(0, 1).to(torch.float32).contiguous()


def _chunked_one(q, k, v, g, beta, state, chunk_size: int):
    """One sequence by the chunked (WY / UT transform) algorithm. q, k [H, L, Dk] and v [H, L, Dv]
    in float32 with q, k already normalised; g, beta [H, L]; state [H, Dk, Dv] float32.
    Returns (out [H, L, Dv], final state)."""
    heads, length, _ = k.shape
    q = q * k.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    num_chunks = (length + pad) // chunk_size
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(heads, num_chunks, chunk_size, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, num_chunks, chunk_size).cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_values)
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :length], state


def _recurrent_one(q, k, v, g, beta, state):
    """The same sequence token by token (the decode step's algorithm); shapes as _chunked_one."""
    q = q / k.shape[-1] ** 0.5
    out = torch.zeros_like(v)
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        memory = (state * k[:, t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, t] - memory) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = (state * q[:, t].unsqueeze(-1)).sum(dim=-2)
    return out, state


def recurrent_keeping_drafts(step, q, k, v, g, beta, state, recurrent_state, rows: list[int]):
    """A verify step's drafted sequence (draft_states.py), token by token as its plain decode
    steps would run it (`step`: the recurrent form, shapes as _chunked_one), the state rounded to
    the cache's dtype between tokens as a decode step stores it; the state after position
    j < len(rows) goes to slot rows[j]. Returns (out, final state)."""
    outs = []
    for t in range(k.shape[1]):
        o, state = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], state)
        state = state.to(recurrent_state.dtype).to(torch.float32)
        outs.append(o)
        if t < len(rows):
            recurrent_state[rows[t]] = state.to(recurrent_state.dtype)
    return torch.cat(outs, dim=1), state


def gated_delta_rule(q, k, v, g, beta, recurrent_state, query_start_loc, state_slots, has_initial_state,
                     chunk_size: int = 64, draft_rows: list[list[int]] | None = None) -> torch.Tensor:
    """The gated delta rule over each sequence, with q and k L2-normalised and q scaled by
    key_dim ** -0.5. A one-token step of a sequence with state takes the recurrent form, every
    other the chunked form (as transformers does). Returns [num_tokens, value_heads, value_dim]
    in v's dtype; each sequence's final state goes back to its slot. `draft_rows` (a verify
    step): sequence i's scratch rows, one per draft (none: not drafted); a drafted sequence runs
    token by token and keeps its state after each draft there (recurrent_keeping_drafts)."""
    out = torch.empty_like(v)
    repeat = v.shape[1] // k.shape[1]
    starts = query_start_loc.tolist()
    for i, (slot, has_state) in enumerate(zip(state_slots.tolist(), has_initial_state.tolist())):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        qi, ki = (l2norm(_heads_first(t[start:end], repeat)) for t in (q, k))
        vi = _heads_first(v[start:end], 1)
        gi, bi = (t[start:end].t().to(torch.float32) for t in (g, beta))
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


def gated_delta_rule_step(q, k, v, g, beta, recurrent_state, state_slots) -> torch.Tensor:
    """One token per sequence, every sequence with state (decode), all sequences at once:
    q, k [num_seqs, key_heads, key_dim], v [num_seqs, value_heads, value_dim]."""
    slots = state_slots.long()
    repeat = v.shape[1] // k.shape[1]
    q, k = (l2norm(t.repeat_interleave(repeat, dim=1).to(torch.float32)) for t in (q, k))
    q = q / k.shape[-1] ** 0.5
    state = recurrent_state[slots].to(torch.float32) * g.to(torch.float32).exp()[..., None, None]
    memory = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v.to(torch.float32) - memory) * beta.to(torch.float32).unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    recurrent_state[slots] = state.to(recurrent_state.dtype)
    return (state * q.unsqueeze(-1)).sum(dim=-2).to(v.dtype)
