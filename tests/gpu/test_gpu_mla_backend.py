"""On the GPU: the Triton MLA backend against the PyTorch one at DeepSeek-V3's per-head sizes
(latent 512 + rope 64, q/k 128 + 64, v 128; 16 heads, a tp=8 rank's share, to keep the
reference quick), bf16 and an fp8 latent cache: a mixed step (prefills, an extend over a 1,500-
token prefix, decodes over up to 3,000 keys), a pure decode step (split-KV), sparse rows (2,048
selected positions of 4,000, DeepSeek-V3.2's top-k) in both; the pure decode step captured in a
CUDA graph replays with new lengths to the eager numbers; and DeepSeek-V3 tiny through the
engine (Triton backend, CUDA graphs) gives the PyTorch backend's greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from metrale import LLM, SamplingParams
from metrale.layers.forward_context import BatchLayout
from metrale.layers.mla.backend import LatentUpProjection
from metrale.layers.mla.torch_backend import TorchMLABackend
from metrale.layers.mla.triton_backend import TritonMLABackend
from mla_checkpoints import make_mla_checkpoint

pytestmark = pytest.mark.gpu

HEADS, RANK, ROPE, NOPE, V, BLOCK = 16, 512, 64, 128, 128, 16
SCALE = (NOPE + ROPE) ** -0.5
FP8 = torch.float8_e4m3fn


def _up(g):
    weight = (torch.randn(HEADS * (NOPE + V), RANK, generator=g) * RANK ** -0.5).cuda().bfloat16()
    heads = weight.view(HEADS, NOPE + V, RANK)
    return LatentUpProjection(lambda latents: F.linear(latents, weight), heads[:, :NOPE], heads[:, NOPE:])


def _step(seq_lens, query_lens, g):
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 8
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in seq_lens) + 2
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots, positions = [], []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        blocks = [order.pop() for _ in range(-(-n // BLOCK))]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append(torch.tensor(blocks).repeat_interleave(BLOCK)[pos] * BLOCK + pos % BLOCK)
        positions.append(pos[n - q:])
    layout = BatchLayout(
        positions=torch.cat(positions).cuda(), query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).int().cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).cuda(), block_tables=tables.cuda(),
        slot_mapping=torch.cat([s[n - q:] for s, n, q in zip(slots, seq_lens, query_lens)]).cuda(),
        state_slots=torch.zeros(len(seq_lens), dtype=torch.int32).cuda(),
        has_initial_state=torch.ones(len(seq_lens), dtype=torch.int32).cuda(),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens), is_pure_decode=all(q == 1 and n > 1 for n, q in zip(seq_lens, query_lens)))
    return layout, slots, num_blocks


def _filled_caches(layout, slots, num_blocks, dtype, latent_scale, g):
    contexts = [torch.randn(len(s), RANK + ROPE, generator=g).cuda().bfloat16() for s in slots]
    caches = []
    for backend in (TorchMLABackend(), TritonMLABackend()):
        cache = torch.zeros(num_blocks, BLOCK, RANK + ROPE, device="cuda", dtype=dtype)
        for s, c in zip(slots, contexts):
            backend.write_latent(c[:, :RANK], c[:, RANK:], cache, s.cuda(), latent_scale)
        caches.append(cache)
    same = (caches[0].view(torch.uint8) != caches[1].view(torch.uint8)).float().mean().item()
    assert same < 1e-3, f"{same:.1%} of the latent bytes differ between the two writes"
    return caches


def _topk(layout, k, g):
    rows = []
    for pos in layout.positions.tolist():
        chosen = [pos] + torch.randperm(pos, generator=g)[:k - 1].tolist() if pos else [0]
        row = torch.tensor(chosen + [-1] * (k - len(chosen)), dtype=torch.int32)
        rows.append(row[torch.randperm(k, generator=g)])
    return torch.stack(rows).cuda()


def _compare(seq_lens, query_lens, sparse, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    layout, slots, num_blocks = _step(seq_lens, query_lens, g)
    latent_scale = 0.05 if dtype == FP8 else 1.0
    torch_cache, triton_cache = _filled_caches(layout, slots, num_blocks, dtype, latent_scale, g)
    up = _up(g)
    tokens = sum(query_lens)
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=g).cuda().bfloat16()
    q_pe = torch.randn(tokens, HEADS, ROPE, generator=g).cuda().bfloat16()
    topk = _topk(layout, 2048, g) if sparse else None
    reference, triton = TorchMLABackend(), TritonMLABackend()
    expected = reference.forward(q_nope, q_pe, torch_cache, up, reference.build_metadata(layout), SCALE, topk,
                                 latent_scale=latent_scale).float()
    got = triton.forward(q_nope, q_pe, triton_cache, up, triton.build_metadata(layout), SCALE, topk,
                         latent_scale=latent_scale).float()
    assert torch.isfinite(got).all()
    err = ((got - expected).norm() / expected.norm()).item()
    assert err < 2e-2, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("sparse", [False, True])
def test_mixed_step_matches_torch_backend(dtype, sparse):
    _compare([300, 1600, 3000, 900, 1], [300, 100, 1, 1, 1], sparse, dtype, seed=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("sparse", [False, True])
def test_pure_decode_step_matches_torch_backend(dtype, sparse):
    _compare([4000, 17, 2500, 3999], [1, 1, 1, 1], sparse, dtype, seed=1)


def test_pure_decode_replays_in_a_cuda_graph():
    g = torch.Generator().manual_seed(2)
    layout, slots, num_blocks = _step([3000, 1200, 40], [1, 1, 1], g)
    _, cache = _filled_caches(layout, slots, num_blocks, torch.bfloat16, 1.0, g)
    up, backend = _up(g), TritonMLABackend()
    q_nope = torch.randn(3, HEADS, NOPE, generator=g).cuda().bfloat16()
    q_pe = torch.randn(3, HEADS, ROPE, generator=g).cuda().bfloat16()
    metadata = backend.build_metadata(layout)
    backend.forward(q_nope, q_pe, cache, up, metadata, SCALE)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q_nope, q_pe, cache, up, metadata, SCALE)
    for lens in ([3000, 1200, 40], [2999, 5, 0]):  # 0: a padded graph row
        layout.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        eager = backend.forward(q_nope, q_pe, cache, up, backend.build_metadata(layout), SCALE)
        torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-3)  # the same kernels; cuBLAS may differ
    assert (out[2] == 0).all()


def test_deepseek_v3_tiny_triton_graphs_match_torch_backend(tmp_path):
    path = make_mla_checkpoint(str(tmp_path), "deepseek_v3")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (1, 17, 100, 250)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(**kw):
        llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=8, **kw)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    llm, graphs = run(attention_backend="triton")
    assert llm.llm_engine.runner.backends["mla"].name == "triton" and llm.llm_engine.runner.graphs is not None
    _, chunked = run(attention_backend="triton", max_num_batched_tokens=16)
    _, reference = run(attention_backend="torch", enforce_eager=True)
    assert graphs == chunked == reference
