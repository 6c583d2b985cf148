"""MLA attention's reference backend: the absorbed form equals the up-projected one, paging and
the mixed batch (prefill, extend over a cached prefix, decode) against a dense computation, and
the layer's cache spec (kind "mla", one plane of kv_lora_rank + qk_rope_head_dim; fp8: one byte a value).
Sparse attention (DSA's `topk_indices`): both forms agree over a selection, a selection of every
causal position is dense attention, and a sparse one is the dense computation over only the
listed positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.config.cache_config import FP8, CacheConfig
from metrale.layers.forward_context import AttentionMetadata
from metrale.layers.mla import MLAAttention, MLADims
from metrale.layers.mla.backend import LatentUpProjection
from metrale.layers.mla.torch_backend import (TorchMLABackend, absorbed_attention, causal_mask,
                                              selection_mask, up_projected_attention)
from metrale.layers.rotary import RotaryEmbedding

HEADS, RANK, ROPE, NOPE, V = 4, 32, 16, 24, 20  # v_head_dim differs from the q/k head size on purpose
SCALE = (NOPE + ROPE) ** -0.5


def _up(generator) -> LatentUpProjection:
    weight = torch.randn(HEADS * (NOPE + V), RANK, generator=generator) * 0.3
    heads = weight.view(HEADS, NOPE + V, RANK)
    return LatentUpProjection(lambda latents: F.linear(latents, weight), heads[:, :NOPE], heads[:, NOPE:])


def _queries(n, generator):
    return torch.randn(n, HEADS, NOPE, generator=generator), torch.randn(n, HEADS, ROPE, generator=generator)


@pytest.mark.parametrize("query_len, seq_len", [(1, 1), (1, 37), (5, 12), (12, 12)])
def test_absorbed_equals_up_projected(query_len, seq_len):
    g = torch.Generator().manual_seed(query_len * 100 + seq_len)
    up = _up(g)
    q_nope, q_pe = _queries(query_len, g)
    entries = torch.randn(seq_len, RANK + ROPE, generator=g)
    mask = causal_mask(query_len, seq_len, q_nope.device)
    absorbed = absorbed_attention(q_nope, q_pe, entries, up, SCALE, mask)
    up_projected = up_projected_attention(q_nope, q_pe, entries, up, SCALE, mask)
    assert absorbed.shape == (query_len, HEADS, V)
    torch.testing.assert_close(absorbed, up_projected, rtol=1e-5, atol=1e-5)


def _random_selection(query_len, seq_len, k, generator) -> torch.Tensor:
    """[query_len, k] int32: each row its own position and up to k - 1 earlier ones, shuffled, -1 padded."""
    rows = []
    for j in range(query_len):
        position = seq_len - query_len + j
        earlier = torch.randperm(position, generator=generator)[:k - 1]
        row = torch.cat((torch.tensor([position]), earlier))
        row = row[torch.randperm(len(row), generator=generator)]
        rows.append(F.pad(row, (0, k - len(row)), value=-1))
    return torch.stack(rows).int()


@pytest.mark.parametrize("query_len, seq_len", [(1, 1), (1, 37), (5, 12), (12, 12), (9, 40)])
def test_sparse_absorbed_equals_sparse_up_projected(query_len, seq_len):
    g = torch.Generator().manual_seed(query_len * 1000 + seq_len)
    up = _up(g)
    q_nope, q_pe = _queries(query_len, g)
    entries = torch.randn(seq_len, RANK + ROPE, generator=g)
    selection = _random_selection(query_len, seq_len, 6, g)
    mask = selection_mask(selection, seq_len)
    if seq_len > 6:
        assert (mask.sum(-1) < causal_mask(query_len, seq_len, q_nope.device).sum(-1)).any()  # really sparse
    absorbed = absorbed_attention(q_nope, q_pe, entries, up, SCALE, mask)
    up_projected = up_projected_attention(q_nope, q_pe, entries, up, SCALE, mask)
    torch.testing.assert_close(absorbed, up_projected, rtol=1e-5, atol=1e-5)


def _dense_attention(q_nope, q_pe, entries, up, selection=None):
    """Every head's k and v spelled out (k = [W_UK c | k_pe], v = W_UV c), causal (or over the
    listed positions of `selection`), no cache."""
    latents, k_pe = entries[:, :RANK], entries[:, RANK:]
    k_nope = torch.einsum("hnr,sr->shn", up.w_uk, latents)
    v = torch.einsum("hvr,sr->shv", up.w_uv, latents)
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, HEADS, -1)), -1)
    q = torch.cat((q_nope, q_pe), -1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * SCALE
    allowed = causal_mask(q.shape[0], k.shape[0], q.device)
    if selection is not None:
        allowed = torch.zeros_like(allowed)
        for j, row in enumerate(selection.tolist()):
            allowed[j, [p for p in row if p >= 0]] = True
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqs,shv->qhv", scores.softmax(-1), v)


def _paged_batch(g, contexts, query_lens, block_size=4):
    """The contexts written into a shuffled paged cache, the step's own rows last -> (backend,
    cache, metadata)."""
    backend = TorchMLABackend()
    cache = torch.full((32, block_size, RANK + ROPE), float("nan"))
    order = torch.randperm(32, generator=g)
    tables, slots_of, taken = [], [], 0
    for context in contexts:
        blocks = order[taken:taken + -(-len(context) // block_size)]
        taken += len(blocks)
        tables.append(blocks)
        slots_of.append(blocks.repeat_interleave(block_size) * block_size + torch.arange(len(blocks) * block_size)
                        % block_size)
    for context, slots, n in zip(contexts, slots_of, query_lens):  # the cached prefixes, from earlier steps
        prefix = len(context) - n
        backend.write_latent(context[:prefix, :RANK], context[:prefix, RANK:], cache, slots[:prefix])
    new = torch.cat([c[-n:] for c, n in zip(contexts, query_lens)])
    slot_mapping = torch.cat([s[len(c) - n:len(c)] for c, s, n in zip(contexts, slots_of, query_lens)])
    backend.write_latent(new[:, :RANK], new[:, RANK:], cache, slot_mapping)
    width = max(len(t) for t in tables)
    block_tables = torch.stack([F.pad(t, (0, width - len(t))) for t in tables]).int()
    seq_lens = [len(c) for c in contexts]
    starts = torch.tensor([0, *query_lens]).cumsum(0).int()
    metadata = AttentionMetadata(slot_mapping, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                                 starts, max(query_lens), max(seq_lens), seq_lens, query_lens)
    return backend, cache, metadata


def _mixed_step(g):
    """Three sequences in one step: a fresh prefill of 7, an extend of 5 over a cached prefix of
    9, a decode over 20; blocks of 4 in a shuffled order."""
    contexts = [torch.randn(n, RANK + ROPE, generator=g) for n in (7, 14, 21)]
    query_lens = [7, 5, 1]
    return contexts, query_lens, *_paged_batch(g, contexts, query_lens)


def test_paged_batch_of_prefill_extend_and_decode_matches_dense_attention():
    """The step writes only its own tokens (the cache starts as NaN)."""
    g = torch.Generator().manual_seed(0)
    up = _up(g)
    contexts, query_lens, backend, cache, metadata = _mixed_step(g)
    q_nope, q_pe = _queries(13, g)
    out = backend.forward(q_nope, q_pe, cache, up, metadata, SCALE)
    start = 0
    for context, n in zip(contexts, query_lens):
        rows = slice(start, start + n)
        torch.testing.assert_close(out[rows], _dense_attention(q_nope[rows], q_pe[rows], context, up),
                                   rtol=1e-5, atol=1e-5)
        start += n


def test_selection_of_every_causal_position_is_dense_attention():
    g = torch.Generator().manual_seed(1)
    up = _up(g)
    contexts, query_lens, backend, cache, metadata = _mixed_step(g)
    q_nope, q_pe = _queries(13, g)
    rows = []
    for context, n in zip(contexts, query_lens):  # every causal position, reversed, padded to 24 columns
        for j in range(n):
            position = len(context) - n + j
            rows.append(F.pad(torch.arange(position, -1, -1), (0, 24 - position - 1), value=-1))
    selection = torch.stack(rows).int()
    dense = backend.forward(q_nope, q_pe, cache, up, metadata, SCALE)
    sparse = backend.forward(q_nope, q_pe, cache, up, metadata, SCALE, topk_indices=selection)
    torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-6)


def test_sparse_paged_batch_matches_dense_attention_over_the_selection():
    """Prefill, extend and decode rows each over 4 of their positions (the decode row takes the
    absorbed form, the others the up-projected one)."""
    g = torch.Generator().manual_seed(2)
    up = _up(g)
    contexts, query_lens, backend, cache, metadata = _mixed_step(g)
    q_nope, q_pe = _queries(13, g)
    selections = [_random_selection(n, len(c), 4, g) for c, n in zip(contexts, query_lens)]
    out = backend.forward(q_nope, q_pe, cache, up, metadata, SCALE, topk_indices=torch.cat(selections))
    dense = backend.forward(q_nope, q_pe, cache, up, metadata, SCALE)
    assert not torch.allclose(out, dense, atol=1e-3)  # the selection drops positions that matter
    start = 0
    for context, n, selection in zip(contexts, query_lens, selections):
        rows = slice(start, start + n)
        expected = _dense_attention(q_nope[rows], q_pe[rows], context, up, selection)
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)
        start += n


def _layer(layer_index=0):
    dims = MLADims(hidden_size=64, num_heads=HEADS, q_lora_rank=None, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                   qk_rope_head_dim=ROPE, v_head_dim=V)

    class Config:  # the rope parameters RotaryEmbedding reads
        rope_parameters = {"rope_theta": 10000.0, "rope_type": "default"}

    return MLAAttention(dims, layer_index, RotaryEmbedding(Config, ROPE, 64), SCALE)


def test_cache_spec_is_one_latent_plane_and_fp8_takes_one_byte_a_value():
    layer = _layer(layer_index=3)
    (spec,) = layer.cache_specs(CacheConfig(block_size=16, model_dtype=torch.bfloat16))
    assert (spec.kind, spec.planes, spec.token_shape, spec.dtype) == ("mla", 1, (RANK + ROPE,), torch.bfloat16)
    assert spec.bytes_per_token == (RANK + ROPE) * 2
    (fp8,) = layer.cache_specs(CacheConfig(block_size=16, model_dtype=torch.bfloat16, kv_cache_dtype="fp8"))
    assert (fp8.dtype, fp8.bytes_per_token) == (FP8, RANK + ROPE)
    skipped = CacheConfig(block_size=16, model_dtype=torch.bfloat16, kv_cache_dtype="fp8",
                          kv_cache_skip_layers=frozenset({3}))
    assert layer.cache_specs(skipped)[0].dtype == torch.bfloat16 != FP8


def test_post_load_hook_splits_kv_b_proj_into_views():
    layer = _layer()
    layer.kv_b_proj.weight.data.copy_(torch.randn(HEADS * (NOPE + V), RANK))
    layer.process_weights_after_loading()
    heads = layer.kv_b_proj.weight.view(HEADS, NOPE + V, RANK)
    assert torch.equal(layer.up.w_uk, heads[:, :NOPE]) and torch.equal(layer.up.w_uv, heads[:, NOPE:])
    assert layer.up.w_uk.data_ptr() == layer.kv_b_proj.weight.data_ptr()  # no second copy
