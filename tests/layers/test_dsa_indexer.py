"""The DSA indexer's PyTorch reference (cache kind "indexer"): its selection over a paged cache
equals transformers' formula computed densely, for prefill, extend over a cached prefix and
decode rows in one step; the FP8 key format (contract: one float32 scale per token, e4m3 keys);
FP8 selections agree with bfloat16's on at least 98% of positions; and the cache specs a full
and a shared MLA layer declare.

Ties: random float scores have none at the top-k boundary (each test checks its margin), so
the selections compare as sets exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.config.cache_config import FP8, CacheConfig
from metrale.layers.forward_context import BatchLayout
from metrale.layers.mla import MLAAttention, MLADims
from metrale.layers.mla.indexer import DSAIndexer, IndexerDims
from metrale.layers.mla.indexer_backend import IndexerCache
from metrale.layers.mla.indexer_fp8 import dequantize_keys, quantize_keys
from metrale.layers.mla.indexer_torch_backend import TorchIndexerBackend, index_scores, top_positions
from metrale.layers.rotary import RotaryEmbedding

HEADS, DIM, TOPK, BLOCK = 8, 32, 6, 4


def _transformers_scores(q, w_raw, keys):
    """transformers' DeepseekV32Indexer scoring: relu(q . k * D^-0.5), weighted by w * H^-0.5."""
    per_head = F.relu(torch.matmul(q.float().transpose(0, 1), keys.float().T) * DIM ** -0.5)  # [H, Q, S]
    return torch.einsum("qh,hqs->qs", w_raw.float() * HEADS ** -0.5, per_head)


def _paged(contexts, query_lens, g, dtype=torch.float32, fp8=False):
    """Each context's keys in a shuffled paged cache (prefix as if from earlier steps, the step's
    rows written now) -> (cache, layout)."""
    backend, blocks_needed = TorchIndexerBackend(), [-(-len(c) // BLOCK) for c in contexts]
    num_blocks, dim = sum(blocks_needed) + 2, contexts[0].shape[1]
    keys = torch.full((num_blocks, BLOCK, dim), float("nan")).to(FP8 if fp8 else dtype)
    cache = IndexerCache(keys, torch.full((num_blocks, BLOCK), float("nan")) if fp8 else None)
    order, taken, tables, slots = torch.randperm(num_blocks, generator=g), 0, [], []
    for n in blocks_needed:
        table = order[taken:taken + n]
        taken += n
        tables.append(table)
        slots.append((table[:, None] * BLOCK + torch.arange(BLOCK)).flatten())
    for context, slot, n in zip(contexts, slots, query_lens):
        backend.write_keys(context[:len(context) - n], cache, slot[:len(context) - n])
    new = torch.cat([c[len(c) - n:] for c, n in zip(contexts, query_lens)])
    slot_mapping = torch.cat([s[len(c) - n:len(c)] for c, s, n in zip(contexts, slots, query_lens)])
    backend.write_keys(new, cache, slot_mapping)
    width = max(blocks_needed)
    seq_lens = [len(c) for c in contexts]
    positions = torch.cat([torch.arange(len(c) - n, len(c)) for c, n in zip(contexts, query_lens)])
    layout = BatchLayout(positions, torch.tensor([0, *query_lens]).cumsum(0).int(),
                         torch.tensor(seq_lens, dtype=torch.int32),
                         torch.stack([F.pad(t, (0, width - len(t))) for t in tables]).int(), slot_mapping,
                         torch.zeros(len(contexts), dtype=torch.int32), torch.zeros(len(contexts), dtype=torch.int32),
                         max(query_lens), max(seq_lens), list(query_lens), seq_lens, False)
    return backend, cache, backend.build_metadata(layout)


def test_paged_selection_matches_transformers_formula_for_prefill_extend_and_decode():
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randn(n, DIM, generator=g) for n in (9, 17, 30, 3)]
    query_lens = [9, 5, 1, 3]  # a prefill, an extend over a prefix of 12, a decode, a prompt shorter than TOPK
    backend, cache, metadata = _paged(contexts, query_lens, g)
    rows = sum(query_lens)
    q = torch.randn(rows, HEADS, DIM, generator=g)
    w_raw = torch.randn(rows, HEADS, generator=g)
    selected = backend.select(q, w_raw * HEADS ** -0.5 * DIM ** -0.5, cache, metadata, TOPK)
    assert selected.shape == (rows, TOPK) and selected.dtype == torch.int32
    start, dropped = 0, 0
    for context, n in zip(contexts, query_lens):
        scores = _transformers_scores(q[start:start + n], w_raw[start:start + n], context)
        for j in range(n):
            position = len(context) - n + j
            order = scores[j, :position + 1].argsort(descending=True)
            keep = min(TOPK, position + 1)
            if keep < position + 1:
                ranked = scores[j, order]
                assert ranked[keep - 1] - ranked[keep] > 1e-5  # no tie at the boundary
                dropped += 1
            row = selected[start + j].tolist()
            assert sorted(p for p in row if p >= 0) == sorted(order[:keep].tolist())
            assert row.count(-1) == TOPK - keep
        start += n
    assert dropped == 3 + 5 + 1  # rows past position TOPK - 1 really drop positions


def test_fp8_keys_have_one_scale_per_token_and_round_to_nearest_even():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(5, DIM, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 0.0])[:, None]
    quantized, scales = quantize_keys(keys)
    assert quantized.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == (5,)
    assert scales[4] == 1.0 and torch.all(quantized[4].float() == 0)  # a zero key: scale 1
    expected_scales = keys[:4].abs().amax(-1) / 448.0
    torch.testing.assert_close(scales[:4], expected_scales, rtol=0, atol=0)
    assert torch.equal(quantized[:4].float(), (keys[:4] / scales[:4, None]).to(FP8).float())
    assert torch.all(quantized[:4].float().abs().amax(-1) == 448.0)  # each token's largest value at the top
    back = dequantize_keys(quantized, scales)
    assert torch.all((back - keys).abs() <= keys.abs().amax(-1, keepdim=True) / 448 * 16 + 1e-12)  # e4m3: 3 bits


def test_fp8_cache_selection_agrees_with_bfloat16_on_98_percent_of_positions():
    """A decode step of 8 sequences over 200-400 positions, 16 heads, index_topk 64: the keys as
    LayerNorm makes them (unit scale), the queries and weights random."""
    g = torch.Generator().manual_seed(2)
    heads, dim, topk = 16, 64, 64
    contexts = [torch.randn(n, dim, generator=g) for n in torch.randint(200, 400, (8,), generator=g).tolist()]
    q = torch.randn(8, heads, dim, generator=g)
    w = torch.randn(8, heads, generator=g) * heads ** -0.5 * dim ** -0.5
    picks = {}
    for fp8 in (False, True):
        backend, cache, metadata = _paged(contexts, [1] * 8, torch.Generator().manual_seed(3),
                                          dtype=torch.bfloat16, fp8=fp8)
        picks[fp8] = backend.select(q.bfloat16().float(), w, cache, metadata, topk)
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picks[False], picks[True]))
    agreement = same / (8 * topk)
    assert agreement >= 0.98, agreement
    assert agreement < 1.0  # fp8 rounding does move some picks: the check has teeth


def _indexer(heads=HEADS):
    return DSAIndexer(IndexerDims(hidden_size=64, q_lora_rank=48, num_heads=heads, head_dim=DIM, rope_dim=16,
                                  index_topk=TOPK), rope_interleaved=False)


class _Rope:
    rope_parameters = {"rope_theta": 10000.0, "rope_type": "default"}


def _mla(layer_index, **dsa):
    dims = MLADims(hidden_size=64, num_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=16, v_head_dim=16)
    return MLAAttention(dims, layer_index, RotaryEmbedding(_Rope, 16, 64), 0.1, **dsa)


@pytest.mark.parametrize("flag, key_dtype", [("auto", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp8", FP8)])
def test_full_layer_declares_latent_then_indexer_specs(flag, key_dtype):
    config = CacheConfig(block_size=16, model_dtype=torch.bfloat16, indexer_cache_dtype=flag)
    latent, *indexer = _mla(0, indexer=_indexer()).cache_specs(config)
    assert latent.kind == "mla" and all(spec.kind == "indexer" for spec in indexer)
    assert (indexer[0].planes, indexer[0].token_shape, indexer[0].dtype) == (1, (DIM,), key_dtype)
    if key_dtype == FP8:
        assert (indexer[1].token_shape, indexer[1].dtype) == ((1,), torch.float32)
        assert sum(s.bytes_per_token for s in indexer) == DIM + 4
    else:
        assert len(indexer) == 1 and indexer[0].bytes_per_token == DIM * 2


def test_shared_layer_declares_no_indexer_cache_and_binds_the_fp8_planes_in_order():
    config = CacheConfig(block_size=4, model_dtype=torch.float32, indexer_cache_dtype="fp8")
    assert [s.kind for s in _mla(1, selection_source=0).cache_specs(config)] == ["mla"]
    full = _mla(0, indexer=_indexer())
    tensors = tuple(torch.zeros(spec.shape(3, 4), dtype=spec.dtype) for spec in full.cache_specs(config))
    full.bind_caches(tensors)
    assert full.indexer.cache.keys.shape == (3, 4, DIM) and full.indexer.cache.keys.dtype == FP8
    assert full.indexer.cache.scales.shape == (3, 4)
    assert full.indexer.cache.scales.data_ptr() == tensors[2].data_ptr()  # a view, not a copy
    full.bind_caches(None)
    assert full.indexer.cache is None and full.latent_cache is None
    with pytest.raises(ValueError, match="only an earlier layer"):
        _mla(2, selection_source=2)
