"""The FP8 block-scaled MoE paths against `fused_experts_fp8_reference` (CPU interpreter without CUDA):
the grouped GEMMs (metrale/kernels/fp8_moe_gemm.py, W8A8 and W8A16), the small-batch GEMVs
(metrale/kernels/fp8_moe_gemv.py, W8A16), the dispatcher's choice between them, and the reference
itself against the bf16 expert loop on dequantized weights. Tiny shapes: 6 experts, top-2, H 80,
I 48, groups of 32, so gate/up, H and I all end in partial blocks; a rank holding experts [1, 5)
sees assignments to experts it does not hold. A `gpu` variant runs Qwen3-30B-A3B's shapes."""

import functools

import pytest
import torch

from metrale.kernels import interpret_mode, kernel_path
from metrale.kernels import fp8_moe_gemm, fp8_moe_gemv
from metrale.kernels.moe_gemv import MoeGemvConfig
from metrale.layers.moe import fused_experts_reference, select_experts
from metrale.layers.moe.fp8_experts import fused_experts_fp8, fused_experts_fp8_reference
from metrale.kernels.fp8_math import dequantize_weight, quantize_weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, TOP_K, H, I, GROUP = 6, 2, 80, 48, 32
START, LOCAL = 1, 4  # this rank's experts: [1, 5) of 6
# fp32: the kernels' products are the reference's (fp8 values times fp32 activations, and e4m3
# quantization bit for bit), only the fp32 summation order differs. bf16: several roundings to
# bf16, and the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest, so loose (as in
# tests/layers/test_moe_small_batch.py).
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (5e-2, 5e-2)}
# bf16 W8A8 under the interpreter: about half of GEMM 1's bf16 outputs (and of silu, silu * up) are
# one bf16 step off the reference's (truncated, not rounded), and e4m3 quantization turns some of
# those into a whole e4m3 step (6-12%) of an activation, or a group's other scale: elementwise
# bounds do not hold, the relative error of the whole output does (measured 2.1-2.8%; dropping the
# activation quantization altogether moves it by ~4%). The fused kernel itself equals, bit for bit,
# torch's quantization of the truncated values (checked by hand). A GPU rounds to nearest.
W8A8_BF16_INTERPRETER_NORM = 3e-2
# The interpreter pays per program: small-batch tests launch whole-row tiles (the default config,
# one row per program, is tested apart).
GEMV_TILES = MoeGemvConfig(block_i=16, block_k1=128, warps1=1, block_n=16, block_k2=64, warps2=1)


@functools.lru_cache(maxsize=None)
def _experts(num_local, group_n, hidden=H, inter=I, group_k=GROUP, seed=0, scale=0.2):
    """Quantized experts: (w13, w2, w13_scale, w2_scale) with group_n13 = group_n2 = group_n."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) * scale
    w2 = torch.randn(num_local, hidden, inter, generator=g) * scale
    q13 = [quantize_weight(w.to(DEVICE), group_n, group_k) for w in w13]
    q2 = [quantize_weight(w.to(DEVICE), group_n, group_k) for w in w2]
    return (torch.stack([q for q, _ in q13]), torch.stack([q for q, _ in q2]),
            torch.stack([s for _, s in q13]), torch.stack([s for _, s in q2]))


def _batch(tokens, dtype=torch.float32, experts=E, top_k=TOP_K, hidden=H, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype=dtype, device=DEVICE)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g).to(DEVICE), top_k)
    return x, weights, ids


def _args(tokens, dtype, group_n, seed=1):
    """Positional arguments of the fp8 expert functions for a rank holding [START, START + LOCAL)."""
    w13, w2, s13, s2 = _experts(LOCAL, group_n)
    x, weights, ids = _batch(tokens, dtype, seed=seed)
    return (x, w13, w2, s13, s2, group_n, group_n, GROUP, weights, ids, START)


def _check(got, args, activation_group=None):
    expected = fused_experts_fp8_reference(*args, activation_group)
    x = args[0]
    assert got.shape == expected.shape and got.dtype == x.dtype and got.device == x.device
    if interpret_mode() and x.dtype == torch.bfloat16 and activation_group is not None:
        error = (got.float() - expected.float()).norm() / expected.float().norm()
        assert error < W8A8_BF16_INTERPRETER_NORM, error
        return
    rtol, atol = TOL[x.dtype]
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("group_n", [1, GROUP])
def test_reference_is_the_expert_loop_on_dequantized_weights(group_n):
    """activation_group None: fused_experts_reference on the dequantized weights, up to fp32 rounding."""
    args = _args(9, torch.float32, group_n)
    x, w13, w2, s13, s2, gn13, gn2, gk, weights, ids, start = args
    w13_f = torch.stack([dequantize_weight(w, s, gn13, gk) for w, s in zip(w13, s13)])
    w2_f = torch.stack([dequantize_weight(w, s, gn2, gk) for w, s in zip(w2, s2)])
    got = fused_experts_fp8_reference(*args)
    torch.testing.assert_close(got, fused_experts_reference(x, w13_f, w2_f, weights, ids, start), rtol=1e-6, atol=1e-6)
    local = ((ids >= start) & (ids < start + LOCAL)).any(dim=1)
    assert not local.all() and torch.equal(got[~local], torch.zeros_like(got[~local]))
    # bf16: the loop on bf16 copies of the dequantized weights (one more rounding of W) is close
    xb = x.bfloat16()
    expected = fused_experts_reference(xb, w13_f.bfloat16(), w2_f.bfloat16(), weights, ids, start)
    got = fused_experts_fp8_reference(xb, *args[1:])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=5e-2, atol=5e-2)


def test_reference_quantizes_both_gemm_inputs():
    """W8A8 differs from W8A16 by the activations' e4m3 rounding (3 mantissa bits): a few percent."""
    args = _args(9, torch.float32, GROUP)
    w8a16, w8a8 = fused_experts_fp8_reference(*args), fused_experts_fp8_reference(*args, GROUP)
    assert 0 < (w8a8 - w8a16).norm() / w8a16.norm() < 0.05


# --------------------------------------------------------------------------- the grouped GEMMs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation_group", [None, GROUP])
@pytest.mark.parametrize("group_n", [1, GROUP])
def test_grouped_gemm_matches_reference(dtype, activation_group, group_n):
    args = _args(24, dtype, group_n)
    _check(fp8_moe_gemm.fused_experts_fp8_triton(*args, activation_group), args, activation_group)


@pytest.mark.parametrize("activation_group,config", [
    # several K tiles per weight scale group and per activation group; several row tiles per expert;
    # N tiles of one scale row (group_n 32 = block_n: scalar weight scales)
    (2 * GROUP, fp8_moe_gemm.Fp8MoeGemmConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)),
    # one N tile wider than N of GEMM 1 (2I = 96) and GEMM 2 (H = 80), tall row tiles (mostly padding)
    (GROUP, fp8_moe_gemm.Fp8MoeGemmConfig(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=2)),
    # 128-row tiles, two N tiles per scale row (scalar weight scales)
    (GROUP, fp8_moe_gemm.Fp8MoeGemmConfig(block_m=128, block_n=16, block_k=32, num_warps=8, num_stages=3)),
])
def test_grouped_gemm_tiles(activation_group, config):
    args = _args(40, torch.float32, GROUP)
    got = fp8_moe_gemm.fused_experts_fp8_triton(*args, activation_group, config=config)
    _check(got, args, activation_group)


def test_grouped_gemm_no_local_expert_gives_zeros():
    x, w13, w2, s13, s2, gn13, gn2, gk, weights, ids, _ = _args(20, torch.float32, GROUP)
    got = fp8_moe_gemm.fused_experts_fp8_triton(x, w13, w2, s13, s2, gn13, gn2, gk, weights, ids % 2 + 4, 0, GROUP)
    assert torch.equal(got, torch.zeros_like(got))  # this rank holds [0, 4), every id is 4 or 5


def test_grouped_gemm_config_rule():
    cfg = fp8_moe_gemm.fp8_moe_gemm_config
    # Qwen3-30B-A3B, 128 experts, top-8, [128, 128] blocks: the docstring's measurements
    assert cfg(8 * 64, 1536, 2048, 128, 128) == (16, 64, 128, 4, 3)
    assert cfg(8 * 256, 1536, 2048, 128, 128) == (64, 64, 128, 4, 3)
    assert cfg(8 * 512, 2048, 768, 128, 128) == (64, 64, 128, 4, 3)
    assert cfg(8 * 2048, 1536, 2048, 128, 128) == (64, 128, 128, 4, 3)
    assert cfg(8 * 4096, 1536, 2048, 128, 128) == (64, 128, 128, 4, 3)
    assert cfg(48, 96, 80, 4, 32) == (16, 64, 32, 4, 3)  # the tests' shapes
    # a group of >= K features (one scale column) bounds nothing; a group of 8 is too narrow for tl.dot
    assert fp8_moe_gemm.k_span(768, 2048, 128) == 128 and fp8_moe_gemm.k_span(768, 2048, None) is None
    assert cfg(64, 2048, 768, 8, None).block_k == 128
    with pytest.raises(ValueError):
        cfg(64, 64, 64, 8, 8)


# --------------------------------------------------------------------------- the small-batch GEMVs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_n", [1, GROUP])
@pytest.mark.parametrize("tokens", [1, 5])
def test_small_batch_matches_reference(dtype, group_n, tokens):
    args = _args(tokens, dtype, group_n, seed=tokens)
    _check(fp8_moe_gemv.fused_experts_fp8_small_batch_triton(*args, config=GEMV_TILES), args)


@pytest.mark.parametrize("tiles", [
    # chunks narrower than a scale group (a group's vectors over several chunks), masked last chunks,
    # I and H not multiples of the row blocks
    MoeGemvConfig(block_i=32, block_k1=16, warps1=1, block_n=32, block_k2=16, warps2=1),
    # chunks wider than H and I: only masked chunks (no full chunk to load before the PDL wait)
    MoeGemvConfig(block_i=64, block_k1=128, warps1=2, block_n=128, block_k2=64, warps2=2),
])
def test_small_batch_tiles(tiles):
    args = _args(3, torch.float32, GROUP)
    _check(fp8_moe_gemv.fused_experts_fp8_small_batch_triton(*args, config=tiles), args)


def test_small_batch_default_config():
    """One gate/up row pair per stage-1 program, one output row per stage-2 program."""
    args = _args(1, torch.float32, 1, seed=3)
    _check(fp8_moe_gemv.fused_experts_fp8_small_batch_triton(*args), args)


def test_small_batch_deterministic_and_zero_where_nothing_is_local():
    x, w13, w2, s13, s2, gn13, gn2, gk, weights, ids, start = _args(6, torch.bfloat16, GROUP)
    ids = ids.clone()
    ids[4] = torch.tensor([5, 0])  # token 4: both experts held elsewhere

    def run(rows):
        return fp8_moe_gemv.fused_experts_fp8_small_batch_triton(
            x[rows], w13, w2, s13, s2, gn13, gn2, gk, weights[rows], ids[rows], start, config=GEMV_TILES)

    first = run(slice(None))
    assert torch.equal(first, run(slice(None)))
    # a token's result does not depend on the other tokens of the batch
    assert torch.equal(first[2:3], run(slice(2, 3)))
    assert torch.equal(first[4], torch.zeros_like(first[4]))


# --------------------------------------------------------------------------- the dispatcher


def test_dispatcher_chooses_by_batch_size(monkeypatch):
    calls = []
    monkeypatch.setattr(fp8_moe_gemv, "fused_experts_fp8_small_batch_triton", lambda *a, **k: calls.append("gemv"))
    monkeypatch.setattr(fp8_moe_gemm, "fused_experts_fp8_triton", lambda *a, **k: calls.append("gemm"))
    with kernel_path("kernels"):
        fused_experts_fp8(*_args(16, torch.float32, GROUP), GROUP)  # I = 48 <= 512: up to MAX_TOKENS (16)
        fused_experts_fp8(*_args(17, torch.float32, GROUP), GROUP)
    assert calls == ["gemv", "gemm"]
    with kernel_path("reference"):
        args = _args(3, torch.float32, GROUP)
        assert torch.equal(fused_experts_fp8(*args, GROUP), fused_experts_fp8_reference(*args, GROUP))
    assert calls == ["gemv", "gemm"]


def test_dispatcher_w8a8_end_to_end():
    """Every kernel of the grouped W8A8 path through the Triton dispatchers (hidden's quantization too)."""
    args = _args(20, torch.float32, GROUP)
    with kernel_path("kernels"):
        got = fused_experts_fp8(*args, GROUP)
    _check(got, args, GROUP)


# --------------------------------------------------------------------------- real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
@pytest.mark.parametrize("activation_group", [128, None])
def test_qwen3_30b_a3b_shapes_gpu(tokens, activation_group):
    """Qwen3-30B-A3B's routed experts: 128 experts, top-8, H 2048, I 768, [128, 128] blocks, bf16.
    Batches of at most 8 tokens take the small-batch GEMVs, larger ones the grouped GEMMs."""
    experts, top_k, hidden, inter, block = 128, 8, 2048, 768, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts * 2 * inter, hidden, device="cuda", generator=g) * 0.02
    w2 = torch.randn(experts * hidden, inter, device="cuda", generator=g) * 0.02
    (q13, s13), (q2, s2) = quantize_weight(w13, block, block), quantize_weight(w2, block, block)
    q13, s13 = q13.view(experts, 2 * inter, hidden), s13.view(experts, 2 * inter // block, hidden // block)
    q2, s2 = q2.view(experts, hidden, inter), s2.view(experts, hidden // block, inter // block)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda", generator=g), top_k)
    args = (x, q13, q2, s13, s2, block, block, block, weights.bfloat16(), ids)
    got = fused_experts_fp8(*args, 0, activation_group)
    # decode batches are W8A16 whatever the activation_group (see fp8_experts)
    expected = fused_experts_fp8_reference(*args, 0, activation_group if tokens > 8 else None)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-2)
    if tokens > 8 and activation_group is not None:  # and the grouped GEMMs' W8A16 variant
        got = fp8_moe_gemm.fused_experts_fp8_triton(*args)
        torch.testing.assert_close(got, fused_experts_fp8_reference(*args), rtol=2e-2, atol=1e-2)
