"""FusedMoE: routing semantics, the expert-parallel / tensor-parallel split, checkpoint layouts,
and the Triton grouped GEMM against the PyTorch reference (CPU interpreter without CUDA)."""

import functools
import importlib
import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is decorated

from metrale.kernels import triton_available  # noqa: E402
from metrale.layers.moe import (FusedMoE, MoEParallelLayout, fused_experts_reference,  # noqa: E402
                                layout_for_topology, select_experts)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I = 8, 32, 48


# --------------------------------------------------------------------------- routing


def test_softmax_routing_with_and_without_renormalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.5, 2.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, 2, "softmax", renormalize=False)
    assert ids.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    assert (weights.sum(-1) < 1).all()
    renormed, ids2 = select_experts(logits, 2, "softmax", renormalize=True)
    assert ids2.tolist() == ids.tolist()
    torch.testing.assert_close(renormed, weights / weights.sum(-1, keepdim=True))
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))


def test_sigmoid_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    scores = torch.sigmoid(logits)
    weights, ids = select_experts(logits, 2, "sigmoid", renormalize=True)
    assert sorted(ids[0].tolist()) == [0, 1]
    # The bias lifts experts 2 and 3 above 0 and 1: they are chosen, weighted by their plain scores.
    bias = torch.tensor([0.0, 0.0, 0.5, 0.9])
    weights, ids = select_experts(logits, 2, "sigmoid", renormalize=True, correction_bias=bias)
    order = ids[0].argsort()
    assert ids[0][order].tolist() == [2, 3]
    expected = scores[0, [2, 3]] / scores[0, [2, 3]].sum()
    torch.testing.assert_close(weights[0][order], expected)
    assert weights.dtype == torch.float32


def test_softmax_weights_are_rounded_to_the_model_dtype_like_transformers():
    layer = FusedMoE(4, 2, 8, 8, scoring="softmax")
    weights, _ = layer.route(torch.randn(3, 4, dtype=torch.bfloat16))
    assert weights.dtype == torch.bfloat16
    layer = FusedMoE(4, 2, 8, 8, scoring="sigmoid", use_correction_bias=True)
    weights, _ = layer.route(torch.randn(3, 4, dtype=torch.bfloat16))
    assert weights.dtype == torch.float32


# --------------------------------------------------------------------------- weights and the split


def _checkpoint(seed=0):
    """Per-expert tensors as a checkpoint holds them: gate/up [I, H], down [H, I]."""
    g = torch.Generator().manual_seed(seed)
    return {(e, s): torch.randn((H, I) if s == "w2" else (I, H), generator=g) * 0.2
            for e in range(E) for s in ("w1", "w3", "w2")}


def _layer(ckpt, layout=None, scoring="softmax", bias=None):
    layer = FusedMoE(E, 2, H, I, scoring=scoring, use_correction_bias=bias is not None, layout=layout)
    for (expert, shard), tensor in ckpt.items():
        param = layer.w2 if shard == "w2" else layer.w13
        param.weight_loader(param, tensor, shard, expert)
    if bias is not None:
        layer.e_score_correction_bias.data.copy_(bias)
    return layer


def _dense_reference(x, logits, ckpt, top_k=2):
    """Every token through its experts one by one, no grouping at all."""
    weights, ids = select_experts(logits, top_k, "softmax", renormalize=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            h = torch.nn.functional.silu(ckpt[e, "w1"] @ x[t]) * (ckpt[e, "w3"] @ x[t])
            out[t] += weights[t, j] * (ckpt[e, "w2"] @ h)
    return out


def test_layer_matches_a_token_by_token_reference():
    ckpt = _checkpoint()
    x, logits = torch.randn(11, H), torch.randn(11, E)
    torch.testing.assert_close(_layer(ckpt)(x, logits), _dense_reference(x, logits, ckpt), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp_size,ep_size", [(1, 2), (2, 1), (2, 2), (1, 3)])
def test_split_parts_sum_to_the_full_layer(tp_size, ep_size):
    ckpt = _checkpoint()
    bias = torch.rand(E)
    x, logits = torch.randn(17, H), torch.randn(17, E)
    full = _layer(ckpt, scoring="sigmoid", bias=bias)(x, logits)
    total = torch.zeros_like(full)
    ranges = set()
    for tp_rank in range(tp_size):
        for ep_rank in range(ep_size):
            layout = MoEParallelLayout(tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size)
            part = _layer(ckpt, layout, scoring="sigmoid", bias=bias)
            assert part.w13.shape == ((part.expert_end - part.expert_start), 2 * I // tp_size, H)
            assert part.w2.shape == ((part.expert_end - part.expert_start), H, I // tp_size)
            ranges.add(part.expert_range)
            total += part(x, logits)
    assert sorted(ranges)[0][0] == 0 and sorted(ranges)[-1][1] == E  # contiguous ranges cover all experts
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_layouts_of_serve_topologies():
    # Overlapping groups (tp == ep == world): whole experts, one range per rank.
    layout = layout_for_topology(1, 2, 1, 2, "ep")
    assert (layout.tp_size, layout.expert_range(8)) == (1, (4, 8))
    # Layout tp: every expert on every rank, the intermediate dimension sliced.
    layout = layout_for_topology(1, 2, 1, 2, "tp")
    assert (layout.expert_range(8), layout.intermediate_slice(48)) == ((0, 8), (24, 48))
    # Orthogonal mesh (world = tp x ep): the EP rank picks the range, the TP rank slices it.
    layout = layout_for_topology(1, 2, 0, 4, "ep")
    assert (layout.expert_range(8), layout.intermediate_slice(48)) == ((0, 2), (24, 48))
    # A mesh with tp == ep (world 4 = 2 x 2) is not overlapping: range by EP rank, sliced by TP rank.
    mesh = layout_for_topology(1, 2, 1, 2, "ep", world_size=4)
    assert (mesh.expert_range(8), mesh.intermediate_slice(48)) == ((4, 8), (24, 48))
    with pytest.raises(ValueError, match="ep_size 1 or ep_size == tp_size"):
        layout_for_topology(0, 2, 0, 4, "tp")
    with pytest.raises(ValueError, match="not divisible"):
        FusedMoE(E, 2, H, 49, layout=layout)
    with pytest.raises(ValueError, match="cannot be split"):
        FusedMoE(2, 2, H, I, layout=layout)


def test_stacked_checkpoint_layout_loads_like_per_expert_tensors():
    ckpt = _checkpoint()
    gate_up = torch.stack([torch.cat([ckpt[e, "w1"], ckpt[e, "w3"]]) for e in range(E)])  # [E, 2I, H]
    down = torch.stack([ckpt[e, "w2"] for e in range(E)])  # [E, H, I]
    for layout in (None, MoEParallelLayout(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)):
        per_expert = _layer(ckpt, layout)
        stacked = FusedMoE(E, 2, H, I, layout=layout)
        stacked.w13.weight_loader(stacked.w13, gate_up, "w13")
        stacked.w2.weight_loader(stacked.w2, down, "w2")
        assert torch.equal(stacked.w13, per_expert.w13) and torch.equal(stacked.w2, per_expert.w2)


def test_weight_loader_rejects_wrong_shapes():
    layer = FusedMoE(E, 2, H, I)
    with pytest.raises(ValueError, match="does not match"):
        layer.weight_loader(layer.w13, torch.zeros(I + 1, H), "w1", 0)
    with pytest.raises(ValueError, match="out of range"):
        layer.weight_loader(layer.w13, torch.zeros(I, H), "w1", E)


# --------------------------------------------------------------------------- Triton grouped GEMM


@pytest.fixture(scope="module")
def triton_moe():
    if not triton_available():
        pytest.skip("triton is not importable (or no CUDA and TRITON_INTERPRET unset)")
    name = "metrale.layers.moe.triton_moe"
    if name in sys.modules:  # imported before TRITON_INTERPRET was set: re-decorate the kernel
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def test_alignment_groups_assignments_into_single_expert_tiles(triton_moe):
    ids = torch.tensor([[0, 3], [3, 1], [1, 0], [3, 2], [3, 0]])
    sorted_ids, block_expert = triton_moe.align_assignments(ids, 4, num_local_experts=2, expert_start=2)
    num_assign = ids.numel()
    tiles = sorted_ids.view(-1, 4)
    flat = ids.flatten()
    seen = []
    for tile, expert in zip(tiles.tolist(), block_expert.tolist()):
        real = [a for a in tile if a < num_assign]
        if expert < 0:
            assert not real
            continue
        assert all(int(flat[a]) == expert + 2 for a in real)
        seen += real
    # Exactly the assignments of experts 2 and 3, each once; experts 0 and 1 live elsewhere.
    assert sorted(seen) == [i for i, e in enumerate(flat.tolist()) if e in (2, 3)]


def _configs(triton_moe, block_m, gate_up, down, fuse_silu=True):
    """(GEMM 1, GEMM 2) configs from (block_n, block_k) pairs."""
    return (triton_moe.MoeGemmConfig(block_m, *gate_up, fuse_silu=fuse_silu),
            triton_moe.MoeGemmConfig(block_m, *down))


@pytest.mark.parametrize("tokens,experts,top_k,expert_start,num_local,blocks", [
    (1, 4, 2, 0, 4, (16, (32, 16), (32, 16))),     # one decode token
    (13, 4, 2, 0, 4, (16, (32, 16), (16, 32))),    # some experts get no token; K a multiple of BLOCK_K
    (40, 4, 2, 0, 4, (16, (64, 32), (64, 32))),    # runs longer than a tile; N and K not multiples of the tile
    (24, 8, 3, 4, 4, (16, (32, 32), (32, 16))),    # the upper half of the experts, top-3
    (70, 4, 2, 0, 4, (32, (16, 16), (32, 16))),    # 32-row tiles, several N tiles of act
    (0, 4, 2, 0, 4, (16, (32, 16), (32, 16))),     # empty batch
])
@pytest.mark.parametrize("fuse_silu", [True, False])
def test_triton_matches_reference(triton_moe, tokens, experts, top_k, expert_start, num_local, blocks, fuse_silu):
    g = torch.Generator().manual_seed(tokens + experts)
    hidden, inter = 32, 48
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(num_local, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g).to(DEVICE), top_k)
    expected = fused_experts_reference(x, w13, w2, weights, ids, expert_start)
    got = triton_moe.fused_experts_triton(x, w13, w2, weights, ids, expert_start,
                                          configs=_configs(triton_moe, *blocks, fuse_silu=fuse_silu))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_fused_silu_rounds_as_the_separate_activation(triton_moe, monkeypatch):
    # 16-bit products rounded before SiLU-and-mul, as F.linear then silu_and_mul: the two GEMM 1
    # forms give the same bits (same tiles, so the same products). fp16: the interpreter's bf16
    # tl.dot is not usable (kernels/skinny_gemm.py)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 32, generator=g).half().to(DEVICE)
    w13 = (torch.randn(4, 64, 32, generator=g) * 0.2).half().to(DEVICE)
    w2 = (torch.randn(4, 32, 32, generator=g) * 0.2).half().to(DEVICE)
    weights, ids = select_experts(torch.randn(24, 4, generator=g).to(DEVICE), 2)
    from metrale.kernels.activation import silu_and_mul_triton

    monkeypatch.setattr(triton_moe, "silu_and_mul", silu_and_mul_triton)  # the GPU's activation kernel, also on CPU
    fused, apart = (triton_moe.fused_experts_triton(x, w13, w2, weights, ids,
                                                    configs=_configs(triton_moe, 16, (32, 32), (32, 32), fuse_silu=f))
                    for f in (True, False))
    assert torch.equal(fused, apart)


def test_triton_default_configs_match_reference(triton_moe):
    # the rule's tiles (what the interpreter and untabled shapes take), 128-wide K steps over K = 32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 32, generator=g).to(DEVICE)
    w13 = (torch.randn(4, 96, 32, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(4, 32, 48, generator=g) * 0.2).to(DEVICE)
    weights, ids = select_experts(torch.randn(20, 4, generator=g).to(DEVICE), 2)
    got = triton_moe.fused_experts_triton(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_experts_reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5)


def test_moe_gemm_config_rule_and_table(triton_moe, monkeypatch, tmp_path):
    rule = triton_moe._rule_configs
    # the first heuristic, unchanged for shapes without a measured entry
    assert rule(8 * 64, 128, 2048, 768) == (triton_moe.MoeGemmConfig(16, 64, 32), triton_moe.MoeGemmConfig(16, 64, 32))
    assert rule(8 * 512, 128, 2048, 768)[0].block_m == 16  # 32 assignments per expert
    assert rule(8 * 4096, 128, 2048, 768)[0].block_m == 64  # 256 assignments per expert
    assert not rule(8 * 4096, 128, 2048, 768)[0].fuse_silu
    # a table entry wins for its shape and capability; the smallest measured token count >= T
    table = tmp_path / "t.json"
    entry = dict(capability=[9, 0], experts=128, top_k=8, hidden=2048, intermediate=768, dtype="bfloat16")
    table.write_text(json.dumps({"entries": [
        dict(entry, tokens=256, gate_up=[64, 64, 128, 4, 3, True], down=[64, 128, 64, 8, 4, False]),
        dict(entry, tokens=64, gate_up=[16, 32, 128, 4, 3, True], down=[16, 64, 128, 4, 3, False])]}))
    monkeypatch.setattr(triton_moe, "TUNED_TABLE", str(table))
    triton_moe._tuned_table.cache_clear()
    monkeypatch.setattr(triton_moe, "interpret_mode", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    pick = functools.partial(triton_moe.moe_gemm_configs, num_experts=128, top_k=8, hidden=2048, inter=768,
                             dtype=torch.bfloat16, device=gpu)
    try:
        assert pick(8 * 20) == (triton_moe.MoeGemmConfig(16, 32, 128, 4, 3, True),
                                triton_moe.MoeGemmConfig(16, 64, 128, 4, 3))
        assert pick(8 * 65)[1] == triton_moe.MoeGemmConfig(64, 128, 64, 8, 4)
        assert pick(8 * 5000)[1] == triton_moe.MoeGemmConfig(64, 128, 64, 8, 4)  # past the end: the largest
        # what the warm-up compiles: every pair a step of up to 300 tokens picks, once each
        assert triton_moe.configs_up_to(300, 128, 8, 2048, 768, torch.bfloat16, gpu) == [pick(8), pick(8 * 256)]
        assert pick(8 * 20, inter=512) == rule(8 * 20, 128, 2048, 512)  # another shape: the rule
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        triton_moe._tuned_table.cache_clear()
        assert pick(8 * 20) == rule(8 * 20, 128, 2048, 768)  # another GPU: the rule
    finally:
        triton_moe._tuned_table.cache_clear()


def test_compile_tiles_launches_each_pair_the_rule_picks(triton_moe):
    # 4 experts, top-2: 16-row tiles up to 64 tokens (128 assignments), 64-row ones past it
    w13 = (torch.randn(4, 96, 32) * 0.2).to(DEVICE)
    w2 = (torch.randn(4, 32, 48) * 0.2).to(DEVICE)
    assert triton_moe.compile_tiles(w13, w2, top_k=2, max_tokens=80) == 2
    assert triton_moe.compile_tiles(w13, w2, top_k=2, max_tokens=64) == 1


def test_shipped_moe_table_is_well_formed(triton_moe):
    with open(triton_moe.TUNED_TABLE) as f:
        entries = json.load(f)["entries"]
    for e in entries:
        gate_up, down = triton_moe.MoeGemmConfig(*e["gate_up"]), triton_moe.MoeGemmConfig(*e["down"])
        assert gate_up.block_m == down.block_m, e  # one alignment serves both GEMMs
        assert all(v & (v - 1) == 0 for v in (*gate_up[:3], *down[:3])), e  # powers of two
        assert not down.fuse_silu, e  # a GEMM 1 option


def test_triton_half_precision(triton_moe):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 32, generator=g).half().to(DEVICE)
    w13 = (torch.randn(4, 64, 32, generator=g) * 0.2).half().to(DEVICE)
    w2 = (torch.randn(4, 32, 32, generator=g) * 0.2).half().to(DEVICE)
    weights, ids = select_experts(torch.randn(9, 4, generator=g).to(DEVICE), 2)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    got = triton_moe.fused_experts_triton(x, w13, w2, weights.half(), ids, configs=_configs(triton_moe, 16, (32, 16), (32, 16)))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
