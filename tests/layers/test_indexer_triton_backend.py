"""The Triton DSA indexer backend against the PyTorch one (cache kind "indexer"), under the
interpreter: the same keys written (bitwise, bf16 and fp8 with its per-token scales, padding
slots skipped), and the same selections for a step mixing a fresh prefill, an extend over a cached
prefix, decodes and a prompt shorter than index_topk, over a shuffled paged cache; `auto` picks
it on CUDA, `kernels` on the CPU."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer_cases import assert_selection_matches
from metrale.kernels.dsa_indexer_reference import indexer_scores
from metrale.layers.cache_backend import get_backend
from metrale.layers.forward_context import BatchLayout
from metrale.layers.mla.indexer_backend import IndexerCache
from metrale.layers.mla.indexer_torch_backend import TorchIndexerBackend
from metrale.layers.mla.indexer_triton_backend import TritonIndexerBackend

HEADS, DIM, TOPK, BLOCK_SIZE, NUM_BLOCKS = 8, 32, 6, 16, 12
FP8 = torch.float8_e4m3fn


def _layout(seq_lens, query_lens, g, pad_rows=0):
    """One step over a shuffled block pool; pad_rows slots of -1 after the last sequence's rows."""
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1, dtype=torch.int32)
    slots = []
    for i, n in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append(tables[i].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    step_slots = torch.cat([s[n - q:] for s, n, q in zip(slots, seq_lens, query_lens)] +
                           [torch.full((pad_rows,), -1, dtype=torch.long)])
    layout = BatchLayout(
        positions=torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, query_lens)] +
                            [torch.zeros(pad_rows, dtype=torch.long)]),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, slot_mapping=step_slots,
        state_slots=torch.zeros(len(seq_lens), dtype=torch.int32),
        has_initial_state=torch.tensor([int(n > q) for n, q in zip(seq_lens, query_lens)], dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens), is_pure_decode=False)
    return layout, slots


@pytest.mark.parametrize("key_dtype", [torch.bfloat16, FP8])
def test_triton_backend_writes_and_selects_as_the_reference(key_dtype):
    g = torch.Generator().manual_seed(0)
    seq_lens, query_lens, pad_rows = [23, 40, 3, 61, 18], [23, 9, 3, 1, 1], 2
    layout, slots = _layout(seq_lens, query_lens, g, pad_rows)
    contexts = [torch.randn(n, DIM, generator=g).bfloat16() for n in seq_lens]
    caches = {}
    for backend in (TorchIndexerBackend(), TritonIndexerBackend()):
        cache = IndexerCache(torch.full((NUM_BLOCKS, BLOCK_SIZE, DIM), float("nan")).to(key_dtype),
                             torch.full((NUM_BLOCKS, BLOCK_SIZE), float("nan")) if key_dtype == FP8 else None)
        for context, slot, q in zip(contexts, slots, query_lens):  # the prefixes, as earlier steps left them
            backend.write_keys(context[:len(context) - q], cache, slot[:len(context) - q])
        new = torch.cat([c[len(c) - q:] for c, q in zip(contexts, query_lens)] + [torch.ones(pad_rows, DIM).bfloat16()])
        backend.write_keys(new, cache, layout.slot_mapping)
        caches[backend.name] = cache
    reference, triton = caches["torch"], caches["triton"]
    assert torch.equal(reference.keys.float().nan_to_num(-1), triton.keys.float().nan_to_num(-1))
    if key_dtype == FP8:
        assert torch.equal(reference.scales.nan_to_num(-1), triton.scales.nan_to_num(-1))

    rows = sum(query_lens) + pad_rows
    q = torch.randn(rows, HEADS, DIM, generator=g).bfloat16()
    weights = torch.randn(rows, HEADS, generator=g) * (HEADS * DIM) ** -0.5
    metadata = TorchIndexerBackend().build_metadata(layout)
    want = TorchIndexerBackend().select(q, weights, reference, metadata, TOPK)
    got = TritonIndexerBackend().select(q, weights, triton, TritonIndexerBackend().build_metadata(layout), TOPK)
    assert got.shape == want.shape == (rows, TOPK) and got.dtype == torch.int32
    assert (got[-pad_rows:] == -1).all() and (want[-pad_rows:] == -1).all()
    # Scores of the reference, for the near-tie rule: dense per sequence, -inf past each row.
    scores = indexer_scores(q, weights, triton.keys, None if triton.scales is None else triton.scales[..., None],
                            layout.block_tables, layout.seq_lens, layout.query_start_loc)
    positions = layout.positions[:rows - pad_rows].tolist()
    assert_selection_matches(got[:rows - pad_rows], scores[:rows - pad_rows], positions, TOPK, tol=1e-5)
    assert_selection_matches(want[:rows - pad_rows], scores[:rows - pad_rows], positions, TOPK, tol=1e-5)


def test_kernels_mode_picks_the_triton_indexer():
    assert isinstance(get_backend("indexer", "kernels", torch.device("cpu")), TritonIndexerBackend)
    assert isinstance(get_backend("indexer", "auto", torch.device("cpu")), TorchIndexerBackend)
