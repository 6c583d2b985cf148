"""The up-projected MLA extend kernel (q/k head size != v's) against a float64 causal computation:
fresh prefills and extends over a prefix, more rows than one tile, k_nope and v as strided views
of one kv_b_proj output, k_pe shared by the heads; a sequence left out of seq_ids keeps its rows."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels.mla_extend import mla_extend_attention

HEADS, NOPE, ROPE, V = 3, 24, 16, 20


def _reference(q_nope, q_pe, k_nope, k_pe, v, scale):
    q_len, seq_len = q_nope.shape[0], k_nope.shape[0]
    scores = (torch.einsum("qhd,shd->hqs", q_nope.double(), k_nope.double())
              + torch.einsum("qhd,sd->hqs", q_pe.double(), k_pe.double())) * scale
    visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqs,shv->qhv", weights, v.double())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_extend_rows_match_reference_and_skipped_sequences_keep_their_rows(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    q_lens, prefix_lens = [5, 1, 40, 3], [0, 6, 9, 2]  # sequence 1 (a decode row) is not taken
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens)]
    taken = [0, 2, 3]
    tokens = sum(q_lens)
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=g).to(dtype)
    q_pe = torch.randn(tokens, HEADS, ROPE, generator=g).to(dtype)
    contexts = sum(seq_lens[i] for i in taken)
    kv = torch.randn(contexts, HEADS, NOPE + V, generator=g).to(dtype)  # as kv_b_proj leaves it
    k_pe = torch.randn(contexts, ROPE, generator=g).to(dtype)
    k_nope, v = kv.split([NOPE, V], dim=-1)
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    cu_k = torch.tensor([0] + [seq_lens[i] for i in taken]).cumsum(0).int()
    out = torch.full((tokens, HEADS, V), float("nan"), dtype=dtype, device=device)
    scale = 0.15

    def dev(t):
        return t.to(device)

    mla_extend_attention(dev(q_nope), dev(q_pe), dev(k_nope), dev(k_pe), dev(v), dev(cu_q),
                         dev(torch.tensor(seq_lens, dtype=torch.int32)), dev(torch.tensor(taken, dtype=torch.int32)),
                         dev(cu_k), max(q_lens), scale, out, config=(16, 16, 4, 1))
    out = out.cpu()
    assert out[cu_q[1]:cu_q[2]].isnan().all(), "wrote the rows of a sequence it was not given"
    for e, i in enumerate(taken):
        rows, ctx = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[e], cu_k[e + 1])
        ref = _reference(q_nope[rows], q_pe[rows], k_nope[ctx], k_pe[ctx], v[ctx], scale)
        torch.testing.assert_close(out[rows].double(), ref, rtol=tol, atol=tol)
