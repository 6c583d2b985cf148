"""The absorbed MLA decode kernel against a float64 computation over the positions each row sees:
dense decode rows, rows of any position through the row map, sparse top-k rows (padding, any
order, positions past the row's keys ignored), one split and many, an fp8 latent cache, and a
padded CUDA-graph row (no keys: zeros). Everything the kernel must not read is NaN."""

from __future__ import annotations

import math

import pytest
import torch

from metrale.kernels.mla_decode import mla_decode_attention

LATENT, ROPE = 32, 16
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _paged_cache(seq_lens, block_size, g, dtype=torch.float32):
    """A shuffled paged cache: slots past each sequence's length and a poison block that every
    table padding entry points at are NaN."""
    n_blocks = [math.ceil(n / block_size) for n in seq_lens]
    total = sum(n_blocks) + 1
    order = torch.randperm(total - 1, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(n_blocks) + 1), total - 1, dtype=torch.int32)
    cache = torch.full((total, block_size, LATENT + ROPE), float("nan"))
    for i, n in enumerate(seq_lens):
        blocks = torch.tensor([order.pop() for _ in range(n_blocks[i])], dtype=torch.int32)
        tables[i, :len(blocks)] = blocks
        pos = torch.arange(n)
        cache[blocks.long()[pos // block_size], pos % block_size] = torch.randn(n, LATENT + ROPE, generator=g)
    return cache.to(dtype), tables


def _reference(q_lat, q_pe, cache, tables, row_seq, row_keys, scale, latent_scale=1.0):
    """row_keys[r]: the positions row r sees. float64."""
    out = []
    block_size = cache.shape[1]
    for r, (seq, keys) in enumerate(zip(row_seq, row_keys)):
        if not keys:
            out.append(torch.zeros(q_lat.shape[1], LATENT, dtype=torch.float64))
            continue
        pos = torch.tensor(keys)
        entries = cache[tables[seq].long()[pos // block_size], pos % block_size].double() * latent_scale
        q = torch.cat((q_lat[r], q_pe[r]), -1).double()  # [H, latent + rope]
        weights = (q @ entries.T * scale).softmax(-1)
        out.append(weights @ entries[:, :LATENT])
    return torch.stack(out)


def _queries(rows, heads, g, dtype):
    return (torch.randn(rows, heads, LATENT, generator=g).to(dtype),
            torch.randn(rows, heads, ROPE, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_dense_decode_rows_match_reference(device, dtype, splits):
    g = torch.Generator().manual_seed(splits)
    seq_lens, heads = [1, 37, 70], 20  # 20 heads: two head blocks of 16, the second partial
    cache, tables = _paged_cache(seq_lens, 16, g)
    q_lat, q_pe = _queries(len(seq_lens), heads, g, dtype)
    scale = 0.2
    out = mla_decode_attention(q_lat.to(device), q_pe.to(device), cache.to(device, dtype), tables.to(device),
                               torch.tensor(seq_lens, dtype=torch.int32, device=device), scale,
                               num_kv_splits=splits, config=(16, 16, 4, 1))
    ref = _reference(q_lat, q_pe, cache.to(dtype), tables, range(3), [list(range(n)) for n in seq_lens], scale)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_row_map_and_sparse_rows_with_padding_and_a_padded_graph_row(device):
    """Rows of positions inside their sequences (as an extend's rows are), some sparse: the
    listed positions in shuffled order with -1 padding and one position past the row's keys,
    which must be ignored; a row of no keys (a padded CUDA-graph row) gives zeros."""
    g = torch.Generator().manual_seed(7)
    seq_lens = [40, 9]
    cache, tables = _paged_cache(seq_lens, 8, g)
    row_seq = [0, 0, 1, 1]
    row_kv_len = [25, 40, 9, 0]
    k = 12
    topk = torch.full((4, k), -1, dtype=torch.int32)
    row_keys = []
    for r, n in enumerate(row_kv_len):
        chosen = torch.randperm(n, generator=g)[:min(n, 7 + r)].tolist() if n else []
        row_keys.append(sorted(chosen))
        topk[r, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        if n and len(chosen) < k:
            topk[r, -1] = n  # past the row's keys: not attended
        topk[r] = topk[r][torch.randperm(k, generator=g)]
    q_lat, q_pe = _queries(4, 16, g, torch.float32)
    args = (q_lat.to(device), q_pe.to(device), cache.to(device), tables.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), 0.3)
    maps = dict(row_seq=torch.tensor(row_seq, dtype=torch.int32, device=device),
                row_kv_len=torch.tensor(row_kv_len, dtype=torch.int32, device=device))
    for splits in (1, 2):
        sparse = mla_decode_attention(*args, **maps, topk_indices=topk.to(device), num_kv_splits=splits,
                                      config=(16, 4, 4, 1))
        ref = _reference(q_lat, q_pe, cache, tables, row_seq, row_keys, 0.3)
        torch.testing.assert_close(sparse.cpu().double(), ref, rtol=1e-4, atol=1e-4)
        dense = mla_decode_attention(*args, **maps, num_kv_splits=splits, config=(16, 8, 4, 1))
        ref = _reference(q_lat, q_pe, cache, tables, row_seq, [list(range(n)) for n in row_kv_len], 0.3)
        torch.testing.assert_close(dense.cpu().double(), ref, rtol=1e-4, atol=1e-4)
        assert not dense.isnan().any() and not sparse.isnan().any()


@pytest.mark.parametrize("variant", ["whole", "split_v"])
def test_fp8_latent_cache_reads_stored_value_times_scale(device, variant):
    g = torch.Generator().manual_seed(3)
    seq_lens = [33, 5]
    cache, tables = _paged_cache(seq_lens, 16, g)
    latent_scale = 0.05
    stored = (cache / latent_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    q_lat, q_pe = _queries(2, 16, g, torch.bfloat16)
    out = mla_decode_attention(q_lat.to(device), q_pe.to(device), stored.to(device), tables.to(device),
                               torch.tensor(seq_lens, dtype=torch.int32, device=device), 0.1,
                               latent_scale=latent_scale, num_kv_splits=2, config=(16, 16, 4, 1, variant))
    ref = _reference(q_lat, q_pe, stored.float(), tables, range(2), [list(range(n)) for n in seq_lens], 0.1,
                     latent_scale)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("variant", ["halves", "split_v"])
@pytest.mark.parametrize("dtype,splits", [(torch.float32, 3), (torch.bfloat16, 1)])
def test_latent_half_variants_match_reference(device, variant, dtype, splits):
    """The two-halves kernel (both value halves in one program, or one per program) on dense rows
    with a partial head block, one split (direct store) and several (the merge)."""
    g = torch.Generator().manual_seed(11)
    seq_lens, heads = [1, 37, 70], 20
    cache, tables = _paged_cache(seq_lens, 16, g)
    q_lat, q_pe = _queries(len(seq_lens), heads, g, dtype)
    out = mla_decode_attention(q_lat.to(device), q_pe.to(device), cache.to(device, dtype), tables.to(device),
                               torch.tensor(seq_lens, dtype=torch.int32, device=device), 0.2,
                               num_kv_splits=splits, config=(16, 16, 4, 1, variant))
    ref = _reference(q_lat, q_pe, cache.to(dtype), tables, range(3), [list(range(n)) for n in seq_lens], 0.2)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_split_v_variant_on_sparse_rows_and_a_padded_graph_row(device):
    """Value halves over two programs on row-mapped sparse rows (padding, a position past the
    row's keys) and a row of no keys: the first half's log-sum-exp serves both halves' merge."""
    g = torch.Generator().manual_seed(5)
    seq_lens = [40, 9]
    cache, tables = _paged_cache(seq_lens, 8, g)
    row_seq, row_kv_len, k = [0, 1, 1], [33, 9, 0], 10
    topk = torch.full((3, k), -1, dtype=torch.int32)
    row_keys = []
    for r, n in enumerate(row_kv_len):
        chosen = torch.randperm(n, generator=g)[:min(n, 6)].tolist() if n else []
        row_keys.append(sorted(chosen))
        topk[r, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        if n:
            topk[r, -1] = n
    q_lat, q_pe = _queries(3, 16, g, torch.float32)
    out = mla_decode_attention(q_lat.to(device), q_pe.to(device), cache.to(device), tables.to(device),
                               torch.tensor(seq_lens, dtype=torch.int32, device=device), 0.3,
                               row_seq=torch.tensor(row_seq, dtype=torch.int32, device=device),
                               row_kv_len=torch.tensor(row_kv_len, dtype=torch.int32, device=device),
                               topk_indices=topk.to(device), num_kv_splits=2, config=(16, 4, 4, 1, "split_v"))
    ref = _reference(q_lat, q_pe, cache, tables, row_seq, row_keys, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-4)


def test_unknown_variant_is_refused_by_name(device):
    q = torch.zeros(1, 16, LATENT, device=device)
    with pytest.raises(ValueError, match="wide"):
        mla_decode_attention(q, torch.zeros(1, 16, ROPE, device=device), torch.zeros(1, 16, LATENT + ROPE, device=device),
                             torch.zeros(1, 1, dtype=torch.int32, device=device),
                             torch.ones(1, dtype=torch.int32, device=device), 1.0, config=(16, 16, 4, 1, "wide"))


def test_default_config_takes_the_measured_large_batch_variant_only_where_it_was_measured():
    from metrale.kernels import mla_decode as D

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert D.default_config(64, 128, bf16, mapped_or_sparse=False) == D.LARGE_BATCH_CONFIG
    assert D.default_config(1, 128, bf16, mapped_or_sparse=False)[:2] == (D.BLOCK_H, D.BLOCK_N)
    assert D.default_config(64, 64, bf16, mapped_or_sparse=False)[:2] == (D.BLOCK_H, D.BLOCK_N)  # tp=2 ranks
    assert D.default_config(64, 128, bf16, mapped_or_sparse=True)[:2] == (D.BLOCK_H, D.BLOCK_N)
    assert D.default_config(64, 128, fp8, mapped_or_sparse=False)[:2] == (D.BLOCK_H, D.FP8_BLOCK_N)


def test_large_batch_default_matches_reference(device):
    """16 rows over 128 heads take LARGE_BATCH_CONFIG (split_v, 128-head programs) by default."""
    g = torch.Generator().manual_seed(7)
    seq_lens = [5 + 3 * i for i in range(16)]
    cache, tables = _paged_cache(seq_lens, 8, g)
    q_lat, q_pe = _queries(16, 128, g, torch.float32)
    out = mla_decode_attention(q_lat.to(device), q_pe.to(device), cache.to(device), tables.to(device),
                               torch.tensor(seq_lens, dtype=torch.int32, device=device), 0.3)
    keys = [list(range(n)) for n in seq_lens]
    ref = _reference(q_lat, q_pe, cache, tables, list(range(16)), keys, 0.3)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-4)
