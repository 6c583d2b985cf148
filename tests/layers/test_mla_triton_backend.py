"""The Triton MLA backend against the PyTorch reference under the interpreter: the latent write
leaves the same cache; a mixed step (fresh prefill, extend over a cached prefix, decodes, a
one-token prompt) and a pure decode step give the same heads, dense and sparse (top-k rows with
padding, in shuffled order), over several blocks of a shuffled cache, float32 or fp8 with a scale; the pure decode step's
metadata holds nothing built on the host (what CUDA graphs need)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.layers.forward_context import BatchLayout
from metrale.layers.mla.backend import LatentUpProjection
from metrale.layers.mla.torch_backend import TorchMLABackend
from metrale.layers.mla.triton_backend import TritonMLABackend

HEADS, RANK, ROPE, NOPE, V = 4, 32, 16, 24, 20
SCALE = (NOPE + ROPE) ** -0.5
BLOCK_SIZE = 4


def _up(g) -> LatentUpProjection:
    weight = torch.randn(HEADS * (NOPE + V), RANK, generator=g) * 0.3
    heads = weight.view(HEADS, NOPE + V, RANK)
    return LatentUpProjection(lambda latents: F.linear(latents, weight), heads[:, :NOPE], heads[:, NOPE:])


def _step(seq_lens, query_lens, g, num_blocks=48):
    """The layout of one step over a shuffled block pool, and the latents of every context."""
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots, positions = [], []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        blocks = [order.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append(torch.tensor(blocks).repeat_interleave(BLOCK_SIZE)[pos] * BLOCK_SIZE + pos % BLOCK_SIZE)
        positions.append(pos[n - q:])
    layout = BatchLayout(
        positions=torch.cat(positions), query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.cat([s[n - q:] for s, n, q in zip(slots, seq_lens, query_lens)]),
        state_slots=torch.zeros(len(seq_lens), dtype=torch.int32),
        has_initial_state=torch.tensor([int(n > q) for n, q in zip(seq_lens, query_lens)], dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens), is_pure_decode=all(q == 1 and n > 1 for n, q in zip(seq_lens, query_lens)))
    contexts = [torch.randn(n, RANK + ROPE, generator=g) for n in seq_lens]
    return layout, slots, contexts


def _caches(layout, slots, contexts, dtype, latent_scale, num_blocks=48):
    """The same cache filled through each backend: prefixes as earlier steps left them, then
    this step's tokens through write_latent. Unwritten slots are NaN; the two caches are equal
    bit for bit."""
    caches = []
    for backend in (TorchMLABackend(), TritonMLABackend()):
        cache = torch.full((num_blocks, BLOCK_SIZE, RANK + ROPE), float("nan")).to(dtype)
        for s, c, q in zip(slots, contexts, layout.query_lens_cpu):
            backend.write_latent(c[:len(c) - q, :RANK], c[:len(c) - q, RANK:], cache, s[:len(c) - q], latent_scale)
        new = torch.cat([c[len(c) - q:] for c, q in zip(contexts, layout.query_lens_cpu)])
        backend.write_latent(new[:, :RANK], new[:, RANK:], cache, layout.slot_mapping, latent_scale)
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    return caches


def _topk(layout, g, k=6):
    """Each row's selection: its own position and up to k-1 earlier ones, shuffled, -1 padded."""
    rows = []
    for pos in layout.positions.tolist():
        chosen = [pos] + torch.randperm(pos, generator=g)[:k - 1].tolist() if pos else [0]
        row = torch.tensor(chosen + [-1] * (k - len(chosen)), dtype=torch.int32)
        rows.append(row[torch.randperm(k, generator=g)])
    return torch.stack(rows)


def _compare(seq_lens, query_lens, seed, sparse, dtype=torch.float32, latent_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    layout, slots, contexts = _step(seq_lens, query_lens, g)
    torch_cache, triton_cache = _caches(layout, slots, contexts, dtype, latent_scale)
    up = _up(g)
    tokens = sum(query_lens)
    q_nope, q_pe = torch.randn(tokens, HEADS, NOPE, generator=g), torch.randn(tokens, HEADS, ROPE, generator=g)
    topk = _topk(layout, g) if sparse else None
    reference, triton = TorchMLABackend(), TritonMLABackend()
    expected = reference.forward(q_nope, q_pe, torch_cache, up, reference.build_metadata(layout), SCALE,
                                 topk_indices=topk, latent_scale=latent_scale)
    metadata = triton.build_metadata(layout)
    got = triton.forward(q_nope, q_pe, triton_cache, up, metadata, SCALE, topk_indices=topk,
                         latent_scale=latent_scale)
    assert got.shape == (tokens, HEADS, V) and not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if sparse:  # the selection changed what the rows see
        dense = triton.forward(q_nope, q_pe, triton_cache, up, metadata, SCALE, latent_scale=latent_scale)
        assert not torch.allclose(dense, got, atol=1e-3)
    return metadata


def test_mixed_step_dense_matches_reference():
    # a fresh prefill of 7, an extend of 5 over 9, two decodes (one over 21 keys), a one-token prompt
    _compare([7, 14, 21, 2, 1], [7, 5, 1, 1, 1], seed=0, sparse=False)


def test_mixed_step_sparse_matches_reference():
    _compare([7, 14, 21, 1], [7, 5, 1, 1], seed=1, sparse=True)


def test_fp8_latent_cache_mixed_and_pure_decode_match_reference():
    for sparse in (False, True):
        _compare([7, 14, 21, 1], [7, 5, 1, 1], seed=3, sparse=sparse, dtype=torch.float8_e4m3fn, latent_scale=0.5)
        _compare([5, 30, 13], [1, 1, 1], seed=4, sparse=sparse, dtype=torch.float8_e4m3fn, latent_scale=0.5)


def test_pure_decode_step_dense_and_sparse_match_reference_with_device_only_metadata():
    for sparse in (False, True):
        metadata = _compare([5, 30, 13], [1, 1, 1], seed=2, sparse=sparse)
        assert metadata.is_pure_decode and metadata.mixed is None
