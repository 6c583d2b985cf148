"""The split-KV decode kernel over several query rows per sequence (a verify step's shape):
real rows equal the causal extend reference, rows past a sequence's query_len repeat the last
real row's bound, a padded sequence (length 0) gives zeros, nothing reads a slot past seq_len
(make_batch fills those with NaN)."""

import pytest
import torch

from metrale.kernels import reference
from metrale.kernels.paged_attention import decode_attention_triton

from test_paged_attention import TOL, make_batch


def padded_batch(device, dtype, query_lens, prefixes, num_queries, num_heads, num_kv_heads, head_dim, seed=0):
    b = make_batch(device, dtype, query_lens, prefixes, num_heads, num_kv_heads, head_dim, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    rows = torch.randn(len(query_lens) * num_queries, num_heads, head_dim, generator=g).to(device, dtype)
    real = [s * num_queries + t for s, n in enumerate(query_lens) for t in range(n)]
    rows[real] = b["q"]
    return b, rows, real


@pytest.mark.parametrize("num_kv_splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_query_decode_matches_extend(device, dtype, num_kv_splits):
    num_queries, query_lens, prefixes = 4, [4, 2, 1, 3, 4], [20, 63, 47, 0, 130]
    b, q, real = padded_batch(device, dtype, query_lens, prefixes, num_queries, 8, 2, 64)
    lens = torch.tensor(query_lens, dtype=torch.int32, device=device)
    out = decode_attention_triton(q, b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"],
                                  num_kv_splits, num_queries=num_queries, query_lens=lens)
    assert out.shape == q.shape and not out.isnan().any()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out[real], reference.extend_attention(**b), rtol=rtol, atol=atol)
    dummy = [r for r in range(q.shape[0]) if r not in real]  # they see every key: a plain decode's bound
    seqs = torch.tensor([r // num_queries for r in dummy])
    expected = reference.decode_attention(q[dummy], b["k_cache"], b["v_cache"], b["block_tables"][seqs.to(device)],
                                          b["seq_lens"][seqs.to(device)], b["scale"])
    torch.testing.assert_close(out[dummy], expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_multi_query_decode_padded_sequence_is_zeros(device, num_kv_splits):
    b, q, real = padded_batch(device, torch.float16, [2, 1], [30, 0], 3, 4, 1, 64)
    b["seq_lens"][1] = 0  # a graph's padded sequence
    lens = torch.tensor([2, 1], dtype=torch.int32, device=device)
    out = decode_attention_triton(q, b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"],
                                  num_kv_splits, num_queries=3, query_lens=lens)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    expected = reference.extend_attention(q[:2], b["k_cache"], b["v_cache"], b["block_tables"][:1],
                                          b["cu_seqlens_q"][:2], b["seq_lens"][:1], 2, b["scale"])
    torch.testing.assert_close(out[:2], expected, rtol=3e-3, atol=3e-3)


def test_one_query_row_is_the_plain_decode(device):
    b = make_batch(device, torch.float16, [1, 1], [9, 70], 8, 2, 64)
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"], 2)
    plain = decode_attention_triton(*args)
    same = decode_attention_triton(*args, num_queries=1)
    assert torch.equal(plain, same)
