"""The gated delta rule (Gated DeltaNet linear attention): chunked prefill/extend over a varlen
batch. Reference: `reference_linear_attention.gated_delta_rule`. The decode step and the gating
are gated_delta_step.py.

Layout (docs/kernels.md, "Gated DeltaNet kernels"):
  q, k              [num_tokens, key_heads, key_dim]; v [num_tokens, value_heads, value_dim]. Any
                    row and head strides, the last dim contiguous (views of the conv's output)
  g, beta           [num_tokens, value_heads], rows may be strided: log decay (fp32) and write
                    strength; the decode step takes the projections a, b [num_seqs, value_heads]
                    and A = -exp(A) (fp32), dt_bias [value_heads] instead
  recurrent_state   [num_slots, value_heads, key_dim, value_dim], each [key_dim, value_dim]
                    matrix contiguous; fp32 (default), bf16 or fp16: the math is fp32, the dtype
                    only rounds what is stored
  query_start_loc, state_slots, has_initial_state: as in the reference (int32; bool or int32)
  out               new [num_tokens, value_heads, value_dim] tensor in v's dtype
Value head h reads key head h // (value_heads // key_heads). q and k are L2-normalised in the
kernels (eps 1e-6 inside the rsqrt) and q is scaled by key_dim ** -0.5. key_dim and value_dim
are powers of two >= 16.

For every token t, with S the state [key_dim, value_dim]:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

Prefill (`gated_delta_rule_triton`) is the chunked form (chunks of 64 tokens; a sequence's last
chunk is partial), three launches:
  1. `_prepare_kernel`, one program per (chunk, value head): the in-chunk cumulative log decay
     G, then the WY form of the chunk's updates. With A the strictly lower part of
     diag(beta) (K K^T * exp(G_i - G_j)) it forms T = (I + A)^-1 (the four diagonal 16x16
     blocks inverted together by elimination in registers, then merged into 32- and 64-blocks
     by inv([[P, 0], [Q, R]]) = [[P^-1, 0], [-R^-1 Q P^-1, R^-1]], four 64x64 products), and
     stores W = T diag(beta exp(G)) K and U = T diag(beta) V.
  2. `_state_kernel`, one program per (sequence, value head, 32 value columns), walks the
     sequence's chunks in order: stores the state at the chunk's start (for 3), turns U into
     the new values V' = U - W S (written over U), and advances S <- exp(G_last) S +
     (K * exp(G_last - G))^T V'. The state comes from the slot (zeros for a fresh sequence) and
     goes back to it after the last chunk.
  3. `_output_kernel`, one program per (chunk, value head, 64 value columns):
     O = scale ((Q * exp(G)) S + ((Q K^T) * exp(G_i - G_j), i >= j) V').
Scratch: G (fp32), W and U (the model dtype), and one state per chunk (the model dtype).
Precision: with fp32 inputs every product is an IEEE fp32 dot (the reference to ~1e-6). With
bf16/fp16 inputs, K K^T takes the raw keys (exact products; the normalisation scales the
result), the solve's products run at tf32 on fp32 operands (raw K and V are exact in tf32), and
the products of stages 2 and 3 take operands in the model dtype (W, U, V', the per-chunk states,
raw Q and K, the decayed keys) with fp32 accumulation; the running state stays fp32.

No kernel is specialised on token, chunk or sequence counts: those are grid sizes or
`do_not_specialize` arguments. The decode step reads nothing on the host; prefill builds its
chunk table on the host from `query_start_cpu` (or query_start_loc, a sync).
"""

from __future__ import annotations

import torch

from metrale.kernels import interpret_mode, tl, triton, use_triton
from metrale.kernels import reference_linear_attention as ref
from metrale.kernels.causal_conv1d import varlen_blocks
from metrale.kernels.gated_delta_step import STATE_BV, _check_heads

CHUNK = 64
SUB = 16  # rows of the solve's blocks (CHUNK = 4 * SUB)
OUTPUT_BV = 64  # value columns per program of the output kernel


# --------------------------------------------------------------------------- shared helpers


@triton.jit
def _mm(a, b, FP32: tl.constexpr, UPCAST: tl.constexpr):
    # a @ b, fp32 accumulation, for operands already in the dot dtype. FP32: fp32 operands at IEEE
    # precision. UPCAST (the interpreter only, whose bf16 tl.dot multiplies raw storage): the same
    # exact products of the rounded operands, in fp32.
    if FP32 or UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _mm_f32(a, b, FP32: tl.constexpr):
    # a @ b on fp32 operands: IEEE for fp32 inputs, tf32 otherwise (the solve of stage 1).
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, input_precision="tf32")


# --------------------------------------------------------------------------- prefill: stage 1


@triton.jit
def _chunk_rows(chunks_ptr, qsl_ptr, chunk):
    # The chunk's first row and its sequence's end row (the chunk table of varlen_blocks).
    seq = tl.load(chunks_ptr + 2 * chunk)
    return tl.load(chunks_ptr + 2 * chunk + 1), tl.load(qsl_ptr + seq + 1)


@triton.jit
def _diagonal_inverse(a, CHUNK: tl.constexpr, SUB: tl.constexpr):
    # a [CHUNK, CHUNK] strictly lower -> the inverse of (I + a)'s diagonal SUB x SUB blocks, as a
    # block-diagonal [CHUNK, CHUNK]. The blocks are taken out as a batch [NB, SUB, SUB] and
    # inverted together by column-oriented elimination: after step j, row j of t is final and
    # every row below it takes -a[:, j] t[j, :]. Element-wise fp32 throughout.
    NB: tl.constexpr = CHUNK // SUB
    same = tl.arange(0, NB)[:, None, None, None] == tl.arange(0, NB)[None, None, :, None]  # [NB, 1, NB, 1]
    blocks = tl.sum(tl.where(same, tl.reshape(a, [NB, SUB, NB, SUB]), 0.0), axis=2)  # [NB, SUB, SUB]
    r = tl.arange(0, SUB)[None, :, None]
    c = tl.arange(0, SUB)[None, None, :]
    t = tl.where(r == c, 1.0, 0.0) + tl.zeros([NB, SUB, SUB], dtype=tl.float32)
    for j in tl.static_range(SUB - 1):
        col = tl.sum(tl.where(c == j, blocks, 0.0), axis=2)  # [NB, SUB]: a[:, j] of every block
        row = tl.sum(tl.where(r == j, t, 0.0), axis=1)  # [NB, SUB]: t[j, :] of every block
        t -= col[:, :, None] * row[:, None, :]
    return tl.reshape(tl.where(same, t[:, :, None, :], 0.0), [CHUNK, CHUNK])


@triton.jit
def _merge_blocks(t, a, size: tl.constexpr, CHUNK: tl.constexpr, FP32: tl.constexpr):
    # t: the inverse of (I + a)'s diagonal blocks of `size` -> that of its blocks of 2 * size:
    # inv([[P, 0], [Q, R]]) = [[P^-1, 0], [-R^-1 Q P^-1, R^-1]], i.e. t - t e t with e the Q blocks
    # of a (rows in the second half of a 2 * size block, columns in its first half).
    r = tl.arange(0, CHUNK)[:, None]
    c = tl.arange(0, CHUNK)[None, :]
    e = tl.where((r // size == c // size + 1) & ((r // size) % 2 == 1), a, 0.0)
    return t - _mm_f32(t, _mm_f32(e, t, FP32), FP32)


@triton.jit
def _prepare_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, qsl_ptr, chunks_ptr, w_ptr, u_ptr, G_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, value_heads, group,
    DK: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
    FP32: tl.constexpr, UPCAST: tl.constexpr,
):
    # grid (num_chunks, value_heads). W, U [num_tokens, value_heads, D] and G [num_tokens,
    # value_heads] are contiguous scratch. Rows past the sequence read zeros, like the
    # reference's padding: they add nothing, and G stays at the last real row's value. Keys and
    # values are read raw, BD columns at a time (so no [CHUNK, DK] fp32 copy stays live), and the
    # keys' normalisation is applied to the products: k_i . k_j = rk_i rk_j (raw_i . raw_j).
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    t0, end = _chunk_rows(chunks_ptr, qsl_ptr, chunk)
    i = tl.arange(0, CHUNK)
    d = tl.arange(0, BD)[None, :]
    live = t0 + i < end
    rows = (t0 + i).to(tl.int64)
    g = tl.load(g_ptr + rows * stride_gt + hv, mask=live, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_bt + hv, mask=live, other=0.0).to(tl.float32)
    G = tl.cumsum(g, axis=0)
    tl.store(G_ptr + rows * value_heads + hv, G, mask=live)
    rmask = live[:, None]
    rows = rows[:, None]

    k_rows = k_ptr + rows * stride_kt + (hv // group) * stride_kh
    kk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    squares = tl.zeros([CHUNK], dtype=tl.float32)
    for c in tl.static_range(0, DK, BD):
        kc = tl.load(k_rows + c + d, mask=rmask, other=0.0)
        kk += _mm(kc, tl.trans(kc), FP32, UPCAST)  # bf16/fp16 products are exact in fp32
        squares += tl.sum(kc.to(tl.float32) * kc.to(tl.float32), axis=1)
    rk = tl.rsqrt(squares + 1e-6)
    # A = strict lower part of diag(beta) (K K^T * exp(G_i - G_j)), K normalised; the exponent
    # is masked before exp, as above the diagonal it is positive and could overflow.
    lower = i[:, None] > i[None, :]
    a = kk * (beta * rk)[:, None] * rk[None, :] * tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
    # T = (I + A)^-1: the diagonal 16-blocks, merged into 32- and then 64-blocks.
    t = _diagonal_inverse(a, CHUNK, SUB)
    t = _merge_blocks(t, a, SUB, CHUNK, FP32)
    t = _merge_blocks(t, a, 2 * SUB, CHUNK, FP32)

    # W = T diag(beta exp(G) rk) K_raw: the keys' part of the new values (against the chunk's
    # initial state); U = T diag(beta) V: the new values if that state were zero. The row
    # scalings go into T's columns, so the raw operands enter the products unrounded.
    t_w = t * (beta * tl.exp(G) * rk)[None, :]
    w_rows = w_ptr + rows * (value_heads * DK) + hv * DK
    for c in tl.static_range(0, DK, BD):
        kc = tl.load(k_rows + c + d, mask=rmask, other=0.0).to(tl.float32)
        tl.store(w_rows + c + d, _mm_f32(t_w, kc, FP32).to(w_ptr.dtype.element_ty), mask=rmask)
    t_u = t * beta[None, :]
    v_rows = v_ptr + rows * stride_vt + hv * stride_vh
    u_rows = u_ptr + rows * (value_heads * DV) + hv * DV
    for c in tl.static_range(0, DV, BD):
        vc = tl.load(v_rows + c + d, mask=rmask, other=0.0).to(tl.float32)
        tl.store(u_rows + c + d, _mm_f32(t_u, vc, FP32).to(u_ptr.dtype.element_ty), mask=rmask)


# --------------------------------------------------------------------------- prefill: stage 2


@triton.jit
def _state_kernel(
    k_ptr, w_ptr, u_ptr, G_ptr, qsl_ptr, first_chunk_ptr, slots_ptr, has_state_ptr, state_ptr, h_ptr,
    stride_kt, stride_kh, stride_ss, stride_sh, value_heads, group,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, FP32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # grid (num_seqs, value_heads, DV // BV); the chunks of one sequence in order. h_ptr:
    # [num_chunks, value_heads, DK, DV] contiguous, the state at each chunk's start.
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    chunk0 = tl.load(first_chunk_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # Rows of the initial state to read: all of them with a state, none without (an index bound,
    # not a scalar mask, which the interpreter mistypes), so a fresh slot's contents never enter.
    has_rows = DK * (tl.load(has_state_ptr + seq) != 0).to(tl.int32)
    kk = tl.arange(0, DK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    dot_dtype: tl.constexpr = w_ptr.dtype.element_ty
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * DV + vv[None, :]
    s = tl.load(s_ptrs, mask=(kk < has_rows)[:, None], other=0.0).to(tl.float32)
    if end > start:
        k_head = k_ptr + (hv // group) * stride_kh
        w_head = w_ptr + hv * DK
        u_head = u_ptr + hv * DV
        h_head = h_ptr + hv * (DK * DV) + kk[:, None] * DV + vv[None, :]
        for i in range(tl.cdiv(end - start, CHUNK)):
            t0 = start + i * CHUNK
            rows = t0 + tl.arange(0, CHUNK)
            rmask = rows < end
            rows = rows.to(tl.int64)
            s_low = s.to(dot_dtype)
            tl.store(h_head + (chunk0 + i) * (value_heads * DK * DV), s_low)
            w = tl.load(w_head + rows[:, None] * (value_heads * DK) + kk[None, :], mask=rmask[:, None], other=0.0)
            u_ptrs = u_head + rows[:, None] * (value_heads * DV) + vv[None, :]
            u = tl.load(u_ptrs, mask=rmask[:, None], other=0.0).to(tl.float32)
            v_new = (u - _mm(w, s_low, FP32, UPCAST)).to(dot_dtype)
            tl.store(u_ptrs, v_new, mask=rmask[:, None])  # in place: only this program touches them
            G = tl.load(G_ptr + rows * value_heads + hv, mask=rmask, other=0.0)
            G_last = tl.load(G_ptr + tl.minimum(t0 + CHUNK, end).to(tl.int64) * value_heads - value_heads + hv)
            k = tl.load(k_head + rows[:, None] * stride_kt + kk[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
            rk = tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)
            k_decayed = (k * (rk * tl.exp(G_last - G))[:, None]).to(dot_dtype)
            s = s * tl.exp(G_last) + _mm(tl.trans(k_decayed), v_new, FP32, UPCAST)
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty))


# --------------------------------------------------------------------------- prefill: stage 3


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, u_ptr, G_ptr, h_ptr, qsl_ptr, chunks_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, value_heads, group, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr, FP32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # grid (num_chunks, value_heads, DV // BV); u_ptr holds the new values V' by now.
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    t0, end = _chunk_rows(chunks_ptr, qsl_ptr, chunk)
    i = tl.arange(0, CHUNK)
    rmask = t0 + i < end
    rows = (t0 + i).to(tl.int64)
    kk = tl.arange(0, DK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    dot_dtype: tl.constexpr = u_ptr.dtype.element_ty
    hk = hv // group
    # Raw q and k enter the products (exact for bf16/fp16 operands); their normalisation and
    # the scale are applied to the results: q_i . k_j = rq_i rk_j (raw_i . raw_j).
    q = tl.load(q_ptr + rows[:, None] * stride_qt + hk * stride_qh + kk[None, :], mask=rmask[:, None], other=0.0)
    k = tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + kk[None, :], mask=rmask[:, None], other=0.0)
    rq = tl.rsqrt(tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1) + 1e-6) * scale
    rk = tl.rsqrt(tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=1) + 1e-6)
    G = tl.load(G_ptr + rows * value_heads + hv, mask=rmask, other=0.0)
    causal = i[:, None] >= i[None, :]
    decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    intra = (_mm(q, tl.trans(k), FP32, UPCAST) * rq[:, None] * rk[None, :] * decay).to(dot_dtype)
    h = tl.load(h_ptr + chunk.to(tl.int64) * (value_heads * DK * DV) + hv * (DK * DV) + kk[:, None] * DV + vv[None, :])
    v_new = tl.load(u_ptr + rows[:, None] * (value_heads * DV) + hv * DV + vv[None, :], mask=rmask[:, None], other=0.0)
    o = _mm(q, h, FP32, UPCAST) * (rq * tl.exp(G))[:, None] + _mm(intra, v_new, FP32, UPCAST)
    tl.store(out_ptr + rows[:, None] * stride_ot + hv * stride_oh + vv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])


def gated_delta_rule_triton(q, k, v, g, beta, recurrent_state, query_start_loc, state_slots, has_initial_state,
                            chunk_size: int = CHUNK, query_start_cpu: list[int] | None = None) -> torch.Tensor:
    """Triton path of `gated_delta_rule` (the chunked form for every sequence; recurrent_state
    updated in place). query_start_cpu: query_start_loc as a host list, which saves a sync."""
    assert chunk_size == CHUNK, f"the kernels are built for chunks of {CHUNK}"
    group, key_dim, value_dim = _check_heads(q, k, v, recurrent_state)
    num_tokens, value_heads = v.shape[:2]
    assert g.shape == (num_tokens, value_heads) and beta.shape == g.shape and g.stride(1) == 1 and beta.stride(1) == 1
    assert v.dtype in (torch.float32, torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype, v.dtype
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    chunks, first_chunk, num_chunks = varlen_blocks(query_start_loc, query_start_cpu, CHUNK)
    num_seqs = state_slots.shape[0]
    if num_chunks == 0:
        return out
    fp32 = v.dtype == torch.float32
    dot_dtype = v.dtype
    upcast = interpret_mode() and not fp32
    dev = v.device
    G = torch.empty((num_tokens, value_heads), dtype=torch.float32, device=dev)
    w = torch.empty((num_tokens, value_heads, key_dim), dtype=dot_dtype, device=dev)
    u = torch.empty((num_tokens, value_heads, value_dim), dtype=dot_dtype, device=dev)
    h = torch.empty((num_chunks, value_heads, key_dim, value_dim), dtype=dot_dtype, device=dev)

    _prepare_kernel[(num_chunks, value_heads)](
        k, v, g, beta, query_start_loc, chunks, w, u, G,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), value_heads, group,
        DK=key_dim, DV=value_dim, BD=min(64, key_dim, value_dim), CHUNK=CHUNK, SUB=SUB, FP32=fp32, UPCAST=upcast,
        num_warps=4)
    bv = min(STATE_BV, value_dim)
    _state_kernel[(num_seqs, value_heads, value_dim // bv)](
        k, w, u, G, query_start_loc, first_chunk, state_slots, has_initial_state, recurrent_state, h,
        k.stride(0), k.stride(1), *recurrent_state.stride()[:2], value_heads, group,
        DK=key_dim, DV=value_dim, BV=bv, CHUNK=CHUNK, FP32=fp32, UPCAST=upcast, num_warps=4)
    bv = min(OUTPUT_BV, value_dim)
    _output_kernel[(num_chunks, value_heads, value_dim // bv)](
        q, k, u, G, h, query_start_loc, chunks, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), value_heads, group,
        key_dim ** -0.5, DK=key_dim, DV=value_dim, BV=bv, CHUNK=CHUNK, FP32=fp32, UPCAST=upcast, num_warps=4)
    return out


# --------------------------------------------------------------------------- dispatch


def gated_delta_rule(q, k, v, g, beta, recurrent_state, query_start_loc, state_slots, has_initial_state,
                     chunk_size: int = CHUNK, query_start_cpu: list[int] | None = None) -> torch.Tensor:
    """The gated delta rule over each sequence of a varlen batch (prefill/extend);
    recurrent_state updated in place. [num_tokens, value_heads, value_dim] in v's dtype."""
    if use_triton(v):
        return gated_delta_rule_triton(q, k, v, g, beta, recurrent_state, query_start_loc, state_slots,
                                       has_initial_state, chunk_size, query_start_cpu)
    return ref.gated_delta_rule(q, k, v, g, beta, recurrent_state, query_start_loc, state_slots, has_initial_state,
                                chunk_size)


