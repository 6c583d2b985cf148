"""The small-batch MoE path (metrale/kernels/moe_gemv.py) against the PyTorch reference, in Triton's
CPU interpreter without CUDA: batch sizes, top-k, expert-parallel ranges, repeated experts, odd
shapes, dtypes, determinism, and FusedMoE's choice between it and the grouped GEMM."""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is decorated

from metrale.kernels import triton_available  # noqa: E402
from metrale.layers.moe import FusedMoE, fused_experts_reference, select_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I = 8, 64, 32
# The interpreter pays per program, not per element: tests launch whole-row tiles (one stage-1
# program per assignment, four stage-2 programs per token); the default config is tested apart.
TILES = dict(block_i=32, block_k1=64, warps1=1, block_n=16, block_k2=32, warps2=1)
# fp32: only the summation order differs. bf16/fp16: several roundings to the model dtype, and the
# interpreter truncates fp32 -> bf16/fp16 where a GPU rounds to nearest, so loose.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 5e-2), torch.float16: (5e-3, 5e-3)}


@pytest.fixture(scope="module")
def moe_gemv():
    if not triton_available():
        pytest.skip("triton is not importable (or no CUDA and TRITON_INTERPRET unset)")
    name = "metrale.kernels.moe_gemv"
    if name in sys.modules:  # imported before TRITON_INTERPRET was set: re-decorate the kernels
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def _weights(num_local, hidden=H, inter=I, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=g) * 0.2).to(dtype=dtype, device=DEVICE)
    w2 = (torch.randn(num_local, hidden, inter, generator=g) * 0.2).to(dtype=dtype, device=DEVICE)
    return w13, w2


def _batch(tokens, top_k, experts=E, hidden=H, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype=dtype, device=DEVICE)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g).to(DEVICE), top_k)
    return x, weights, ids


def _run(moe_gemv, x, w13, w2, weights, ids, expert_start=0, tiles=TILES):
    config = moe_gemv.MoeGemvConfig(**tiles) if tiles is not None else None
    return moe_gemv.fused_experts_small_batch_triton(x, w13, w2, weights, ids, expert_start, config=config)


def _check(got, x, w13, w2, weights, ids, expert_start=0):
    expected = fused_experts_reference(x, w13, w2, weights, ids, expert_start)
    assert got.shape == expected.shape and got.dtype == x.dtype and got.device == x.device
    rtol, atol = TOL[x.dtype]
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_matches_reference_fp32(moe_gemv, tokens, top_k):
    w13, w2 = _weights(E)
    x, weights, ids = _batch(tokens, top_k, seed=tokens * 10 + top_k)
    _check(_run(moe_gemv, x, w13, w2, weights, ids), x, w13, w2, weights, ids)


def test_default_config(moe_gemv):
    """The H200 config (one gate/up row pair per stage-1 program, one output row per stage-2 program)."""
    w13, w2 = _weights(E)
    x, weights, ids = _batch(2, 2)
    _check(_run(moe_gemv, x, w13, w2, weights, ids, tiles=None), x, w13, w2, weights, ids)


@pytest.mark.parametrize("tokens,top_k,expert_start,num_local", [
    (3, 2, 4, 4),    # the upper half of the experts: ids below the range
    (16, 4, 2, 3),   # a middle range: ids on both sides
    (5, 1, 6, 2),    # top-1: many tokens have no local expert at all
])
def test_expert_parallel_ranges(moe_gemv, tokens, top_k, expert_start, num_local):
    w13, w2 = _weights(num_local)
    x, weights, ids = _batch(tokens, top_k, seed=expert_start)
    local = (ids >= expert_start) & (ids < expert_start + num_local)
    assert local.any() and not local.all()
    got = _run(moe_gemv, x, w13, w2, weights, ids, expert_start)
    _check(got, x, w13, w2, weights, ids, expert_start)
    none_local = ~local.any(dim=1)
    assert torch.equal(got[none_local], torch.zeros_like(got[none_local]))  # exactly zero, not just close


def test_no_local_expert_gives_zeros(moe_gemv):
    w13, w2 = _weights(2)
    x, weights, ids = _batch(4, 2)
    ids = ids % 4 + 4  # every id in [4, 8), this rank holds [0, 2)
    got = _run(moe_gemv, x, w13, w2, weights, ids, 0)
    assert torch.equal(got, torch.zeros_like(got))


def test_repeated_experts_within_a_token(moe_gemv):
    w13, w2 = _weights(E)
    x, _, _ = _batch(3, 4)
    ids = torch.tensor([[2, 2, 5, 2], [7, 7, 7, 7], [1, 6, 1, 3]], device=DEVICE)
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.5, 0.2, 0.2, 0.1]], device=DEVICE)
    _check(_run(moe_gemv, x, w13, w2, weights, ids), x, w13, w2, weights, ids)
    # a rank holding experts 5..7: the repeated 7s are local, the repeated 2s and 1s foreign
    w13_l, w2_l = w13[5:], w2[5:]
    _check(_run(moe_gemv, x, w13_l, w2_l, weights, ids, 5), x, w13_l, w2_l, weights, ids, 5)


@pytest.mark.parametrize("hidden,inter,tiles", [
    # H and I not multiples of the chunks (masked last chunks), I not a multiple of block_i,
    # H not a multiple of block_n (clamped rows), several chunks per row in both stages
    (48, 24, dict(block_i=16, block_k1=32, warps1=1, block_n=32, block_k2=16, warps2=1)),
    (40, 20, dict(block_i=8, block_k1=16, warps1=1, block_n=16, block_k2=8, warps2=2)),
    # chunks wider than H and I: only masked chunks (no full chunk to load before the PDL wait)
    (40, 20, dict(block_i=32, block_k1=64, warps1=1, block_n=64, block_k2=32, warps2=1)),
    # the same with the chunk loops unrolled at compile time: several chunks and a masked tail,
    # then no full chunk at all
    (48, 24, dict(block_i=16, block_k1=32, warps1=1, block_n=32, block_k2=16, warps2=1, unrolled=True)),
    (40, 20, dict(block_i=8, block_k1=16, warps1=1, block_n=16, block_k2=8, warps2=2, unrolled=True)),
    (40, 20, dict(block_i=32, block_k1=64, warps1=1, block_n=64, block_k2=32, warps2=1, unrolled=True)),
])
def test_odd_shapes(moe_gemv, hidden, inter, tiles):
    w13, w2 = _weights(E, hidden, inter)
    x, weights, ids = _batch(3, 2, hidden=hidden)
    _check(_run(moe_gemv, x, w13, w2, weights, ids, tiles=tiles), x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights_dtype", ["model", "float32"])
def test_half_precision(moe_gemv, dtype, weights_dtype):
    """Rounded where the reference rounds; routing weights in the model dtype (softmax routing) or
    float32 (sigmoid routing)."""
    w13, w2 = _weights(E, dtype=dtype)
    x, weights, ids = _batch(6, 4, dtype=dtype)
    if weights_dtype == "model":
        weights = weights.to(dtype)
    _check(_run(moe_gemv, x, w13, w2, weights, ids), x, w13, w2, weights, ids)
    # and close to the float32 computation from the same rounded inputs
    expected32 = fused_experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    torch.testing.assert_close(_run(moe_gemv, x, w13, w2, weights, ids).float(), expected32, rtol=5e-2, atol=5e-2)


def test_deterministic(moe_gemv):
    w13, w2 = _weights(E, dtype=torch.bfloat16)
    x, weights, ids = _batch(16, 4, dtype=torch.bfloat16)
    first = _run(moe_gemv, x, w13, w2, weights, ids)
    assert torch.equal(first, _run(moe_gemv, x, w13, w2, weights, ids))
    # a token's result does not depend on the other tokens of the batch
    assert torch.equal(first[5:6], _run(moe_gemv, x[5:6], w13, w2, weights[5:6], ids[5:6]))


def test_strided_hidden_and_empty_batch(moe_gemv):
    w13, w2 = _weights(E)
    x, weights, ids = _batch(3, 2)
    xs = torch.cat([x, x], dim=1)[:, :H]  # row stride 2H
    _check(_run(moe_gemv, xs, w13, w2, weights, ids), xs, w13, w2, weights, ids)
    empty = _run(moe_gemv, x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, H)


def test_config_is_a_pure_function_of_the_shapes(moe_gemv):
    cfg = moe_gemv.moe_gemv_config
    # Qwen3-Next-80B-A3B (tests/kernels/compile_sm90.py compiles exactly these) and Qwen3-30B-A3B, bf16
    assert cfg(2048, 512, 10) == moe_gemv.MoeGemvConfig(block_i=2, block_k1=2048, warps1=8, block_n=8,
                                                          block_k2=128, warps2=4, unrolled=True, per_assignment=True)
    assert cfg(2048, 768, 8) == moe_gemv.MoeGemvConfig(block_i=2, block_k1=2048, warps1=8, block_n=8,
                                                         block_k2=128, warps2=4, unrolled=True, per_assignment=True)
    assert not cfg(2880, 2880, 4).unrolled  # 45 chunks of 64: a loop
    for hidden, inter, top_k in [(2048, 512, 10), (2048, 768, 8), (4096, 1536, 8), (7168, 2048, 8), (64, 32, 2),
                                 (40, 20, 3), (2048, 256, 10), (2880, 2880, 4)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            c = cfg(hidden, inter, top_k, dtype)
            assert c == cfg(hidden, inter, top_k, dtype)
            assert all(v & (v - 1) == 0 for v in c[:6]), c
            assert c.block_k1 <= hidden and c.block_k2 <= inter, c  # at least one full chunk (PREFETCH)


def test_threshold():
    from metrale.kernels.moe_gemv import MAX_TOKENS, use_small_batch

    assert MAX_TOKENS == 16
    assert all(use_small_batch(t) for t in range(1, MAX_TOKENS + 1))
    assert not use_small_batch(MAX_TOKENS + 1) and not use_small_batch(512)
    # Wider experts (Qwen3-30B-A3B's 768) cross over to the grouped GEMM past 8 tokens on an H200.
    assert use_small_batch(8, 768) and not use_small_batch(9, 768)


def _moe_layer(tokens, seed=0):
    torch.manual_seed(seed)
    layer = FusedMoE(E, 2, H, I)
    layer.w13.data.copy_(torch.randn_like(layer.w13) * 0.2)
    layer.w2.data.copy_(torch.randn_like(layer.w2) * 0.2)
    return layer.to(DEVICE), torch.randn(tokens, H, device=DEVICE), torch.randn(tokens, E, device=DEVICE)


@pytest.mark.parametrize("tokens,path", [(1, "small"), (16, "small"), (17, "grouped")])
def test_fused_moe_dispatch_on_cuda(moe_gemv, monkeypatch, tokens, path):
    """FusedMoE on CUDA tensors (use_triton patched true): at most MAX_TOKENS tokens take the
    small-batch path, more the grouped GEMM."""
    import metrale.layers.moe.layer as layer_mod
    import metrale.layers.moe.triton_moe as triton_moe

    calls = []

    def spy(name):
        def experts(hidden, w13, w2, topk_weights, topk_ids, expert_start=0):
            calls.append((name, hidden.shape[0], expert_start))
            return torch.zeros_like(hidden)
        return experts

    monkeypatch.setattr(layer_mod, "use_triton", lambda t: True)
    monkeypatch.setattr(moe_gemv, "fused_experts_small_batch_triton", spy("small"))
    monkeypatch.setattr(triton_moe, "fused_experts_triton", spy("grouped"))
    layer, x, logits = _moe_layer(tokens)
    layer(x, logits)
    assert calls == [(path, tokens, 0)]


def test_fused_moe_forward_through_the_kernels(moe_gemv, monkeypatch):
    import metrale.layers.moe.layer as layer_mod

    layer, x, logits = _moe_layer(3, seed=3)
    expected = fused_experts_reference(x, layer.w13, layer.w2, *layer.route(logits))
    monkeypatch.setattr(layer_mod, "use_triton", lambda t: True)  # CPU tensors too, through the interpreter
    torch.testing.assert_close(layer(x, logits), expected, rtol=1e-5, atol=1e-5)


# Stage 2 as one program per (assignment, row block), the token's last program summing the k
# partials: the same contract, including experts held elsewhere and the counters' reset.
PER_ASSIGNMENT = dict(TILES, block_n=16, per_assignment=True)


@pytest.mark.parametrize("tokens,top_k,expert_start,num_local", [(1, 2, 0, E), (16, 4, 0, E), (5, 3, 2, 3)])
def test_per_assignment_stage_two(moe_gemv, tokens, top_k, expert_start, num_local):
    w13, w2 = _weights(num_local)
    x, weights, ids = _batch(tokens, top_k, seed=tokens)
    got = _run(moe_gemv, x, w13, w2, weights, ids, expert_start, tiles=PER_ASSIGNMENT)
    _check(got, x, w13, w2, weights, ids, expert_start)
    # the counters are back at zero: a second launch gives the same bits
    assert torch.equal(got, _run(moe_gemv, x, w13, w2, weights, ids, expert_start, tiles=PER_ASSIGNMENT))
    from metrale.kernels.arrivals import arrival_counters

    assert not arrival_counters(x.device, 1).any()


@pytest.mark.parametrize("hidden,inter,tiles", [
    (48, 24, dict(block_i=16, block_k1=32, warps1=1, block_n=32, block_k2=16, warps2=1, per_assignment=True)),
    (40, 20, dict(block_i=32, block_k1=64, warps1=1, block_n=64, block_k2=32, warps2=1, per_assignment=True)),
    (40, 20, dict(block_i=8, block_k1=16, warps1=1, block_n=16, block_k2=8, warps2=2, per_assignment=True)),
    (48, 24, dict(block_i=16, block_k1=32, warps1=1, block_n=32, block_k2=16, warps2=1, per_assignment=True,
                  unrolled=True)),
])
def test_stage_two_variants_odd_shapes(moe_gemv, hidden, inter, tiles):
    w13, w2 = _weights(E, hidden, inter)
    x, weights, ids = _batch(3, 2, hidden=hidden)
    _check(_run(moe_gemv, x, w13, w2, weights, ids, tiles=tiles), x, w13, w2, weights, ids)


@pytest.mark.parametrize("tokens,fused", [(1, True), (16, True), (17, False)])
def test_forward_routed_by_fuses_the_router_for_decode_batches(moe_gemv, monkeypatch, tokens, fused):
    """FusedMoE.forward_routed_by: with CUDA-like tensors (use_triton patched true, the interpreter
    running the kernels) decode batches route in the fused router kernel, larger ones through the
    router module; the output is the layer's own either way."""
    import metrale.kernels.moe_routing as moe_routing
    import metrale.layers.moe.layer as layer_mod

    layer, x, _ = _moe_layer(tokens, seed=tokens)
    router = torch.nn.Linear(H, E, bias=False).to(DEVICE)
    expected = layer(x, router(x))  # on CPU: the PyTorch routing and reference experts
    calls = []
    fused_kernel = moe_routing.router_softmax_topk_triton
    monkeypatch.setattr(moe_routing, "router_softmax_topk_triton",
                        lambda *a, **k: calls.append(a[0].shape[0]) or fused_kernel(*a, **k))
    monkeypatch.setattr(layer_mod, "use_triton", lambda t: True)
    torch.testing.assert_close(layer.forward_routed_by(x, router), expected, rtol=1e-5, atol=1e-5)
    assert calls == ([tokens] if fused else [])
    # a router with a bias, or routing the kernel does not do, goes through the router module
    calls.clear()
    biased = torch.nn.Linear(H, E, bias=True).to(DEVICE)
    layer.forward_routed_by(x, biased)
    assert calls == []
