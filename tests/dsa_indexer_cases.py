"""Mixed batches over a paged indexer cache, and the selection check, shared by the DSA indexer
kernel tests (tests/kernels/test_dsa_indexer_kernels.py), their GPU variant
(tests/gpu/test_gpu_indexer.py) and the Triton indexer backend's test."""

import math

import torch

from metrale.kernels import dsa_indexer_reference as reference

FP8 = torch.float8_e4m3fn
# Scores are float32 sums of float32-accumulated dots: kernel and reference differ by rounding only.
SCORE_TOL = dict(rtol=1e-5, atol=1e-5)


def make_indexer_batch(device, key_dtype, q_lens, prefixes, num_heads, head_dim, block_size=16, pad_rows=0,
                       seed=0):
    """Keys written through the reference into a shuffled paged cache whose unwritten slots and
    poison block (where every unused block-table entry points) are NaN, so a kernel reading past
    a sequence shows up. pad_rows extra query rows after the last sequence's (graph padding)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefixes, q_lens)]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    poison = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), poison, dtype=torch.int32)
    slots = []
    for i, n in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append(block_tables[i].long()[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.cat(slots).to(device)
    key_cache = torch.full((num_blocks, block_size, head_dim), float("nan"), device=device).to(key_dtype)
    scale_cache = torch.full((num_blocks, block_size, 1), float("nan"), device=device) if key_dtype == FP8 else None
    keys = torch.randn(len(slot_mapping), head_dim, generator=g).to(device=device, dtype=torch.bfloat16)
    reference.write_indexer_keys(keys, key_cache, scale_cache, slot_mapping)
    rows = sum(q_lens) + pad_rows
    q = torch.randn(rows, num_heads, head_dim, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(rows, num_heads, generator=g) * (num_heads * head_dim) ** -0.5).to(device)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(device=device, dtype=torch.int32)
    return dict(q=q, w=w, key_cache=key_cache, scale_cache=scale_cache, block_tables=block_tables.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc=cu)


def row_positions_cpu(q_lens, prefixes, pad_rows=0):
    return [p + j for q, p in zip(q_lens, prefixes) for j in range(q)] + [-1] * pad_rows


def assert_selection_matches(got, scores, positions, index_topk, tol):
    """got int32 [T, k] against the reference scores: each row holds min(k, p + 1) distinct visible
    positions and -1 after them, and differs from the reference's selection only by positions
    whose reference score is within tol of the row's k-th largest (near ties, in either order)."""
    want = reference.select_topk(scores, index_topk)
    for t, p in enumerate(positions):
        count = min(index_topk, p + 1)
        row = got[t].tolist()
        chosen = [x for x in row if x >= 0]
        assert row[len(chosen):] == [-1] * (index_topk - len(chosen)), f"row {t}: -1 padding not at the end"
        assert len(chosen) == count == len(set(chosen)) and all(0 <= x <= p for x in chosen), f"row {t}"
        differ = set(chosen) ^ set(x for x in want[t].tolist() if x >= 0)
        if differ:
            kth = scores[t, want[t, count - 1]].item()
            near = [abs(scores[t, x].item() - kth) <= tol * max(1.0, abs(kth)) for x in differ]
            assert all(near), f"row {t}: positions {sorted(differ)} are not near ties at the k-th score {kth}"
