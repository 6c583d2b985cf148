"""Up-projected MLA attention for prefill and extend rows: q/k head size (qk_nope + rope, 192 on
DeepSeek-V3) differs from v's (128), causal over each sequence's whole context.

The backend up-projects every context token's latent through kv_b_proj (layers/mla/backend.py),
so this kernel reads dense per-step tensors, not the paged cache:
  q_nope [T, heads, nope], q_pe [T, heads, rope]   the step's query rows (flattened batch)
  k_nope [S, heads, nope], v [S, heads, v_dim]     every context token of the sequences taken
  k_pe   [S, rope]                                 the roped shared key: one for all heads
  cu_q   int32 [num_seqs + 1], seq_lens int32 [num_seqs]: the step's layout
  seq_ids int32 [E]: the sequences this launch computes (the others' rows are left alone);
  cu_k   int32 [E + 1]: sequence seq_ids[e]'s context is rows cu_k[e]..cu_k[e+1] of k/v, its
         positions 0..seq_lens[seq]-1 in order
Query row j of a sequence with q_len rows sits at position seq_len - q_len + j and sees keys
0..that position. score = scale * (q_nope . k_nope + q_pe . k_pe): the two parts are two dots,
so neither side is padded to 256 nor is k_pe copied per head. Softmax online in fp32 (exp2).
Sparse (top-k) rows do not come here: the backend runs them in the absorbed form.
"""

from __future__ import annotations

import torch

from metrale.kernels import interpret_mode, pdl_args, pdl_wait, tl, triton
from metrale.kernels.paged_attention import LOG2E, _dot

# Hopper defaults, not yet timed on a GPU. At DeepSeek-V3's 128 + 64 / 128, compiled for sm_90
# here: 64 x 64 tiles over 8 warps take 241 registers and 80 KiB of shared memory, no spills
# (4 warps spill at 64 x 64).
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2


@triton.jit
def _extend_tile(acc, m_i, l_i, q_nope, q_pe, kn_ptr, kp_ptr, v_ptr, k0, start, kv_end, q_pos, head,
                 stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                 dn, dn_mask, dr, dr_mask, dv, dv_mask, scale_log2e,
                 MASK_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Invariant: every row has a visible key in its first tile (key 0), so m_i is finite after it.
    n = start + tl.arange(0, BLOCK_N)
    n_valid = n < kv_end
    t = (k0 + n).to(tl.int64)
    k_nope = tl.load(kn_ptr + t[:, None] * stride_knt + head * stride_knh + dn[None, :],
                     mask=n_valid[:, None] & dn_mask[None, :], other=0.0)
    k_pe = tl.load(kp_ptr + t[:, None] * stride_kpt + dr[None, :], mask=n_valid[:, None] & dr_mask[None, :],
                   other=0.0)
    qk = _dot(q_nope, tl.trans(k_nope), PRECISION, UPCAST) + _dot(q_pe, tl.trans(k_pe), PRECISION, UPCAST)
    qk = qk * scale_log2e
    if MASK_CAUSAL:
        qk = tl.where((n[None, :] <= q_pos[:, None]) & n_valid[None, :], qk, float("-inf"))
    else:
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + t[:, None] * stride_vt + head * stride_vh + dv[None, :],
                mask=n_valid[:, None] & dv_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _mla_extend_kernel(
    qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, seq_ids_ptr, cu_k_ptr,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
    stride_ot, stride_oh, scale_log2e,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid: (cdiv(max_q_len, BLOCK_M), E, heads): BLOCK_M query rows of one head of one sequence.
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    e = tl.program_id(1)
    head = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + e)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    k0 = tl.load(cu_k_ptr + e)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    tok = m0 + tl.arange(0, BLOCK_M)
    row_valid = tok < q_len
    q_pos = seq_len - q_len + tok
    dn = tl.arange(0, BLOCK_DN)
    dn_mask = dn < NOPE
    dr = tl.arange(0, BLOCK_DR)
    dr_mask = dr < ROPE
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < V_DIM
    rows = (q_start + tok).to(tl.int64)
    q_nope = tl.load(qn_ptr + rows[:, None] * stride_qnt + head * stride_qnh + dn[None, :],
                     mask=row_valid[:, None] & dn_mask[None, :], other=0.0)
    q_pe = tl.load(qp_ptr + rows[:, None] * stride_qpt + head * stride_qph + dr[None, :],
                   mask=row_valid[:, None] & dr_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Keys <= the tile's first query position are visible to every row: no causal mask there.
    first_pos = seq_len - q_len + m0
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_end = seq_len - q_len + tl.minimum(m0 + BLOCK_M, q_len)  # one past the last key any row sees
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _extend_tile(acc, m_i, l_i, q_nope, q_pe, kn_ptr, kp_ptr, v_ptr, k0, start, kv_end, q_pos,
                                     head, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                                     dn, dn_mask, dr, dr_mask, dv, dv_mask, scale_log2e,
                                     MASK_CAUSAL=False, BLOCK_N=BLOCK_N, PRECISION=PRECISION, UPCAST=UPCAST)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _extend_tile(acc, m_i, l_i, q_nope, q_pe, kn_ptr, kp_ptr, v_ptr, k0, start, kv_end, q_pos,
                                     head, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                                     dn, dn_mask, dr, dr_mask, dv, dv_mask, scale_log2e,
                                     MASK_CAUSAL=True, BLOCK_N=BLOCK_N, PRECISION=PRECISION, UPCAST=UPCAST)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dv_mask[None, :])


def mla_extend_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                         v: torch.Tensor, cu_q: torch.Tensor, seq_lens: torch.Tensor, seq_ids: torch.Tensor,
                         cu_k: torch.Tensor, max_q_len: int, scale: float, out: torch.Tensor | None = None, *,
                         config: tuple | None = None) -> torch.Tensor:
    """Writes the rows of the sequences in `seq_ids` into `out` [T, heads, v_dim] (new when None:
    the other rows are then left unwritten) and returns it. `max_q_len`: a host int >= their
    query lengths. `config`: (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    tokens, heads, nope = q_nope.shape
    rope, v_dim = q_pe.shape[2], v.shape[2]
    assert q_pe.shape[:2] == (tokens, heads) and k_nope.shape[1:] == (heads, nope) and v.shape[:2] == k_nope.shape[:2]
    assert k_pe.shape == (k_nope.shape[0], rope)
    assert all(t.stride(-1) == 1 for t in (q_nope, q_pe, k_nope, k_pe, v))
    assert all(t.dtype == q_nope.dtype for t in (q_pe, k_nope, k_pe, v))
    assert seq_ids.dtype == cu_k.dtype == cu_q.dtype == seq_lens.dtype == torch.int32
    if out is None:
        out = torch.empty((tokens, heads, v_dim), dtype=q_nope.dtype, device=q_nope.device)
    if seq_ids.shape[0] == 0 or max_q_len == 0:
        return out
    block_m, block_n, num_warps, num_stages = config or (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES)
    block_m = min(block_m, max(16, triton.next_power_of_2(max_q_len)))
    _mla_extend_kernel[(triton.cdiv(max_q_len, block_m), seq_ids.shape[0], heads)](
        q_nope, q_pe, k_nope, k_pe, v, out, cu_q, seq_lens, seq_ids, cu_k,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1), scale * LOG2E,
        NOPE=nope, ROPE=rope, V_DIM=v_dim, BLOCK_DN=triton.next_power_of_2(nope),
        BLOCK_DR=triton.next_power_of_2(rope), BLOCK_DV=triton.next_power_of_2(v_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if q_nope.dtype == torch.float32 else None,
        UPCAST=interpret_mode() and q_nope.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(),
    )
    return out
