"""The decode step of the gated delta rule (Gated DeltaNet linear attention), with the gating
fused in, and the gating on its own (for prefill). References:
`reference_linear_attention.gated_delta_rule_step`, `gdn_gating`. The chunked prefill is
gated_delta_rule.py; layouts are in its docstring and docs/kernels.md.

Gates, as transformers computes them: g = A softplus(a + dt_bias) in fp32, with A = -exp(A_log)
(fp32, computed once by the layer), and beta = sigmoid(b) rounded to b's dtype.

The decode step (`gated_delta_rule_step_triton`) runs one program per (sequence, value head, 32
value columns) that reads its [key_dim, 32] block of the state once, applies the token and
writes it back; the gates are computed in the same program. A negative slot is a padding row:
its state is neither read nor written, its output is zero. It reads nothing on the host and is
specialised on no count (CUDA graphs replay it at any batch size).

The verify step of speculative decoding (`gated_delta_rule_verify_triton`) is the decode step
over each sequence's 1 + k tokens in turn, keeping the state after each draft in a scratch row
(layers/linear_attention/draft_states.py); reference:
`reference_linear_attention.gated_delta_rule(..., draft_rows=...)`.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl_args, pdl_wait, tl, triton, use_triton
from metrale.kernels import reference_linear_attention as ref

STATE_BV = 32  # value columns per program of the decode step


@triton.jit
def _softplus(x):
    # torch's softplus (threshold 20); log1p(e) as log(u) * e / (u - 1) with u = 1 + e, which is
    # exact to rounding even where u rounds to 1 (then it is e).
    e = tl.exp(x)
    u = 1.0 + e
    tiny = u == 1.0
    log1p = tl.where(tiny, e, tl.log(u) * (e / tl.where(tiny, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _gates(a, b, A, dt_bias, beta_dtype: tl.constexpr):
    # g = A softplus(a + dt_bias) in fp32 (A = -exp(A)); beta = sigmoid(b) rounded to b's dtype, as
    # transformers computes them (b.sigmoid() in the model dtype).
    g = A * _softplus(a + dt_bias)
    beta = tl.sigmoid(b).to(beta_dtype).to(tl.float32)
    return g, beta


# --------------------------------------------------------------------------- gating


@triton.jit(do_not_specialize=["num_rows"])
def _gating_kernel(a_ptr, b_ptr, A_ptr, dt_bias_ptr, g_ptr, beta_ptr, num_rows, heads, stride_a, stride_b,
                   BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    # grid (cdiv(num_rows, BLOCK_R),); all heads of BLOCK_R rows. g, beta are contiguous.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, BLOCK_H)
    hmask = h < heads
    mask = (r < num_rows)[:, None] & hmask[None, :]
    A = tl.load(A_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    rows = r.to(tl.int64)[:, None]
    a = tl.load(a_ptr + rows * stride_a + h[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_b + h[None, :], mask=mask, other=0.0).to(tl.float32)
    g, beta = _gates(a, b, A[None, :], dt_bias[None, :], beta_ptr.dtype.element_ty)
    tl.store(g_ptr + rows * heads + h[None, :], g, mask=mask)
    tl.store(beta_ptr + rows * heads + h[None, :], beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating_triton(a, b, A, dt_bias):
    """Triton path of `gdn_gating`: a, b [num_tokens, value_heads] (rows may be strided) ->
    (g fp32, beta in b's dtype), both new contiguous tensors."""
    assert a.dim() == 2 and a.shape == b.shape and a.stride(1) == 1 and b.stride(1) == 1, (a.shape, b.shape)
    num_rows, heads = a.shape
    assert A.shape == (heads,) and dt_bias.shape == (heads,)
    g = torch.empty((num_rows, heads), dtype=torch.float32, device=a.device)
    beta = torch.empty((num_rows, heads), dtype=b.dtype, device=b.device)
    if num_rows == 0:
        return g, beta
    block_h = max(triton.next_power_of_2(heads), 2)
    block_r = max(1, 2048 // block_h)
    _gating_kernel[(triton.cdiv(num_rows, block_r),)](
        a, b, A, dt_bias, g, beta, num_rows, heads, a.stride(0), b.stride(0),
        BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4)
    return g, beta


# --------------------------------------------------------------------------- decode step


@triton.jit
def _step_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dt_bias_ptr, state_ptr, slots_ptr, out_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_an, stride_bn,
    stride_ss, stride_sh, stride_on, stride_oh,
    group, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr,
):
    # grid (num_seqs, value_heads, DV // BV). One [DK, BV] block of one state, read once and
    # written once: the kernel is bound by those bytes, so everything else is on the side. The
    # parameters are read before waiting for the previous kernel (PDL), activations after.
    n = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // group
    kk = tl.arange(0, DK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    A = tl.load(A_ptr + hv).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    pdl_wait(PDL)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    n64 = n.to(tl.int64)
    out_ptrs = out_ptr + n64 * stride_on + hv * stride_oh + vv
    if slot < 0:  # a padding row
        tl.store(out_ptrs, tl.zeros([BV], dtype=out_ptr.dtype.element_ty))
        return
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * DV + vv[None, :]
    s = tl.load(s_ptrs).to(tl.float32)
    q = tl.load(q_ptr + n64 * stride_qn + hk * stride_qh + kk).to(tl.float32)
    k = tl.load(k_ptr + n64 * stride_kn + hk * stride_kh + kk).to(tl.float32)
    v = tl.load(v_ptr + n64 * stride_vn + hv * stride_vh + vv).to(tl.float32)
    a = tl.load(a_ptr + n64 * stride_an + hv).to(tl.float32)
    b = tl.load(b_ptr + n64 * stride_bn + hv).to(tl.float32)
    g, beta = _gates(a, b, A, dt_bias, b_ptr.dtype.element_ty)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    decay = tl.exp(g)
    # Both reductions read the loaded state (rather than the output reading the updated one), so
    # they run side by side: S' = decay S + k delta^T gives S'^T q = decay S^T q + delta (k . q).
    sk = tl.sum(s * k[:, None], axis=0)
    sq = tl.sum(s * q[:, None], axis=0)
    delta = (v - decay * sk) * beta
    s = s * decay + k[:, None] * delta[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty))
    tl.store(out_ptrs, (decay * sq + delta * tl.sum(k * q, axis=0)).to(out_ptr.dtype.element_ty))


def _check_heads(q, k, v, recurrent_state):
    _, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    assert k.shape == q.shape and v.shape[0] == q.shape[0], (q.shape, k.shape, v.shape)
    assert value_heads % key_heads == 0, (key_heads, value_heads)
    assert recurrent_state.shape[1:] == (value_heads, key_dim, value_dim), recurrent_state.shape
    for dim in (key_dim, value_dim):
        assert dim >= 16 and dim & (dim - 1) == 0, "head dims must be powers of two >= 16"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head dims must be contiguous"
    assert recurrent_state.stride()[2:] == (value_dim, 1), "each state matrix must be contiguous"
    return value_heads // key_heads, key_dim, value_dim


def gated_delta_rule_step_triton(q, k, v, a, b, A, dt_bias, recurrent_state, state_slots) -> torch.Tensor:
    """Triton path of the decode step with the gating fused in: q, k [num_seqs, key_heads,
    key_dim], v [num_seqs, value_heads, value_dim], a, b [num_seqs, value_heads] (rows may be
    strided), one token per sequence, every sequence with state (slot < 0: padding row).
    recurrent_state is updated in place; returns [num_seqs, value_heads, value_dim] in v's dtype."""
    group, key_dim, value_dim = _check_heads(q, k, v, recurrent_state)
    num_seqs, value_heads = v.shape[:2]
    assert a.shape == (num_seqs, value_heads) and b.shape == a.shape and a.stride(1) == 1 and b.stride(1) == 1
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    bv = min(STATE_BV, value_dim)
    _step_kernel[(num_seqs, value_heads, value_dim // bv)](
        q, k, v, a, b, A, dt_bias, recurrent_state, state_slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        *recurrent_state.stride()[:2], out.stride(0), out.stride(1),
        group, key_dim ** -0.5,
        DK=key_dim, DV=value_dim, BV=bv, num_warps=4, **pdl_args(),
    )
    return out


# --------------------------------------------------------------------------- verify step


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dt_bias_ptr, state_ptr, slots_ptr, has_state_ptr, qsl_ptr,
    num_drafts_ptr, rows_ptr, out_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_an, stride_bn,
    stride_ss, stride_sh, stride_on, stride_oh, stride_rows,
    group, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, DRAFTED_ONLY: tl.constexpr,
):
    # grid (num_seqs, value_heads, DV // BV). The decode step over each sequence's tokens in
    # turn, its [DK, BV] state block held in registers: read once, written after each drafted
    # position into that draft's scratch row, and after the last token into the slot. The state
    # is rounded to its stored dtype after every token, as consecutive decode steps store it.
    n = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // group
    num_drafts = tl.load(num_drafts_ptr + n)
    if DRAFTED_ONLY and num_drafts == 0:
        return  # a prefill chunk or plain decode row: the chunked kernel computed it
    kk = tl.arange(0, DK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    A = tl.load(A_ptr + hv).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    n64 = n.to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    start = tl.load(qsl_ptr + n).to(tl.int64)
    length = tl.load(qsl_ptr + n + 1) - tl.load(qsl_ptr + n)
    block = hv * stride_sh + kk[:, None] * DV + vv[None, :]
    s = tl.load(state_ptr + slot * stride_ss + block).to(tl.float32)
    s = tl.where(tl.load(has_state_ptr + n) != 0, s, 0.0)
    for j in range(0, length):
        t64 = start + j
        q = tl.load(q_ptr + t64 * stride_qn + hk * stride_qh + kk).to(tl.float32)
        k = tl.load(k_ptr + t64 * stride_kn + hk * stride_kh + kk).to(tl.float32)
        v = tl.load(v_ptr + t64 * stride_vn + hv * stride_vh + vv).to(tl.float32)
        a = tl.load(a_ptr + t64 * stride_an + hv).to(tl.float32)
        b = tl.load(b_ptr + t64 * stride_bn + hv).to(tl.float32)
        g, beta = _gates(a, b, A, dt_bias, b_ptr.dtype.element_ty)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        decay = tl.exp(g)
        sk = tl.sum(s * k[:, None], axis=0)
        sq = tl.sum(s * q[:, None], axis=0)
        delta = (v - decay * sk) * beta
        s = (s * decay + k[:, None] * delta[None, :]).to(state_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t64 * stride_on + hv * stride_oh + vv,
                 (decay * sq + delta * tl.sum(k * q, axis=0)).to(out_ptr.dtype.element_ty))
        if j < num_drafts:
            row = tl.load(rows_ptr + n64 * stride_rows + j).to(tl.int64)
            tl.store(state_ptr + row * stride_ss + block, s.to(state_ptr.dtype.element_ty))
    tl.store(state_ptr + slot * stride_ss + block, s.to(state_ptr.dtype.element_ty))


def gated_delta_rule_verify_triton(q, k, v, a, b, A, dt_bias, recurrent_state, state_slots, has_initial_state,
                                   query_start_loc, num_drafts, state_rows, out=None) -> torch.Tensor:
    """A verify step's gated delta rule (speculative decoding), token by token with the gating
    fused in: q, k [num_tokens, key_heads, key_dim], v [num_tokens, value_heads, value_dim], a, b
    [num_tokens, value_heads]. Sequence i's state after its position j < num_drafts[i] goes to
    slot state_rows[i, j] (int32 [num_seqs, k]), after its last token to state_slots[i]
    (layers/linear_attention/draft_states.py). Without `out`, every sequence is computed (a step
    of decodes and verifies only) into a new tensor; with it, only the drafted sequences are,
    into `out` (the chunked kernel computed the others)."""
    group, key_dim, value_dim = _check_heads(q, k, v, recurrent_state)
    value_heads = v.shape[1]
    num_seqs = state_slots.shape[0]
    assert a.shape == v.shape[:2] and b.shape == a.shape and a.stride(1) == 1 and b.stride(1) == 1
    assert state_rows.shape[0] == num_seqs and state_rows.stride(1) == 1, state_rows.shape
    drafted_only = out is not None
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0 or v.shape[0] == 0:
        return out
    bv = min(STATE_BV, value_dim)
    _verify_kernel[(num_seqs, value_heads, value_dim // bv)](
        q, k, v, a, b, A, dt_bias, recurrent_state, state_slots, has_initial_state, query_start_loc,
        num_drafts, state_rows, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        *recurrent_state.stride()[:2], out.stride(0), out.stride(1), state_rows.stride(0),
        group, key_dim ** -0.5,
        DK=key_dim, DV=value_dim, BV=bv, DRAFTED_ONLY=drafted_only, num_warps=4,
    )
    return out


# --------------------------------------------------------------------------- dispatch


def gdn_gating(a, b, A, dt_bias):
    """(g fp32, beta in b's dtype) from the a, b projections [num_tokens, value_heads]."""
    if use_triton(a):
        return gdn_gating_triton(a, b, A, dt_bias)
    return ref.gdn_gating(a, b, A, dt_bias)


def gated_delta_rule_step(q, k, v, a, b, A, dt_bias, recurrent_state, state_slots) -> torch.Tensor:
    """One decode token per sequence, the gates computed from a, b; recurrent_state updated in place."""
    if use_triton(v):
        return gated_delta_rule_step_triton(q, k, v, a, b, A, dt_bias, recurrent_state, state_slots)
    g, beta = ref.gdn_gating(a, b, A, dt_bias)
    return ref.gated_delta_rule_step(q, k, v, g, beta, recurrent_state, state_slots)
