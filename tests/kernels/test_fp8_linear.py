"""The FP8 linear kernels (fp8_quant, fp8_gemv, fp8_gemm, the fp8_linear dispatcher) against
`kernels/fp8_math.py`, on CPU through the Triton interpreter at tiny shapes, and at
Qwen3-8B shapes on a GPU (`gpu` marker)."""

import logging

import pytest
import torch

from metrale.kernels import kernel_path, set_programmatic_launch
from metrale.kernels.fp8_gemm import (Fp8GemmConfig, block_k_for_groups, fp8_gemm_config, fp8_gemm_triton,
                                      groups_supported)
from metrale.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv_config, fp8_gemv_triton
from metrale.kernels.fp8_linear import fp8_linear
from metrale.kernels.fp8_quant import quantize_activation, quantize_activation_triton
from metrale.kernels import fp8_math as fm

# The kernels and the reference compute the same float32 products (W8A8: of the same fp8 values,
# the activation quantization being bitwise equal) and differ only in summation order, so fp32 is
# tight. 16-bit y is rounded once from float32: one step of the output dtype (2^-8 relative in
# bf16; the interpreter truncates fp32 -> bf16 instead of rounding, so up to 2^-7). The W8A16 GEMM
# also rounds each dequantized weight to x's dtype (relative 2^-8 in bf16, 2^-7 truncated, 2^-11
# in fp16), which moves y by at most that times sum_k |x_k W_nk|: `_close` adds that bound.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-3),
       torch.float16: dict(rtol=2 ** -10, atol=1e-3)}
W_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -11}
# On a Hopper GPU an fp8 tensor-core dot accumulates within its K tile in a narrower format than
# fp32 (about 13 mantissa bits; Triton's sm_90 default max_num_imprecise_acc = 2^30 never
# promotes inside a dot): the W8A8 GEMM promotes to fp32 once per K tile, so each tile's partial
# sum may be off by a few 2^-13 of its sum of |products|. The interpreter's fp8 dots are exact.
FP8_DOT_ACC = 2 ** -10
DTYPES = [torch.float32, torch.bfloat16]


def _weight(device, N, K, group_n, group_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    q, s = fm.quantize_weight(w, group_n, group_k)
    return q.to(device), s.to(device)


def _x(device, dtype, M, K, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g).to(dtype=dtype, device=device)


def _bias(device, dtype, N, bias, seed=2):
    if not bias:
        return None
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


def _close(y, x, w, s, gn, gk, b, ag, weight_rounded=False):
    """y against the reference computed in float32 from the same (dtype-rounded) inputs, within
    TOL plus the bounds above: when the kernel rounds the dequantized weight to x's dtype, and
    for the W8A8 GEMM's fp8 dots on a GPU (ag is passed only for the W8A8 GEMM)."""
    ref = fm.fp8_linear_reference(x.float(), w, s, gn, gk, None if b is None else b.float(), ag)
    assert y.dtype == x.dtype and y.shape == ref.shape
    tol = TOL[x.dtype]
    bound = tol["rtol"] * ref.abs() + tol["atol"]
    abs_sum = x.float().abs() @ fm.dequantize_weight(w, s, gn, gk).abs().T  # sum_k |x_k W_nk|
    if weight_rounded:
        bound += W_ROUNDING[x.dtype] * abs_sum
    if ag is not None and y.is_cuda:
        bound += FP8_DOT_ACC * abs_sum
    err = (y.float() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, error / bound {(err / bound).max().item():.3g}"


# ----------------------------------------------------------------------------- activation quantization

def _assert_bitwise(q, s, ref_q, ref_s):
    assert q.dtype == fm.FP8_DTYPE and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s, ref_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,group", [(5, 96, 32), (3, 48, 32), (4, 80, 48), (2, 100, 128), (3, 256, 16)])
def test_quantize_bitwise(device, dtype, M, K, group):
    # partial last group (48 = 32 + 16), a group not a power of two, one group >= K, many groups
    x = _x(device, dtype, M, K)
    x[0, :group] = 0  # an all-zero group: MIN_SCALE, zeros
    x[-1] *= torch.logspace(-6, 3, K, device=device).to(dtype)  # e4m3 subnormals and saturation
    q, s = quantize_activation_triton(x, group)
    _assert_bitwise(q, s, *fm.quantize_activation(x, group))


def test_quantize_rounds_to_nearest_even(device):
    # Every e4m3 value, the midpoints between neighbours (ties to even) and the floats either
    # side of them; amax 448 makes the scale 1, so x / scale is x.
    grid = torch.arange(256, dtype=torch.uint8).view(fm.FP8_DTYPE).float()
    grid = grid[~grid.isnan()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    x = x.view(1, -1).to(device)
    q, s = quantize_activation_triton(x, x.shape[1])
    _assert_bitwise(q, s, *fm.quantize_activation(x, x.shape[1]))


def test_quantize_strided_rows_and_dispatch(device):
    x = _x(device, torch.bfloat16, 3, 128)
    xs = torch.cat([x, x], dim=1)[:, :128]  # row stride 256
    q, s = quantize_activation_triton(xs, 32)
    _assert_bitwise(q, s, *fm.quantize_activation(x, 32))
    _assert_bitwise(*quantize_activation(x, 32), *fm.quantize_activation(x, 32))  # CPU: the reference itself


# ----------------------------------------------------------------------------- GEMV (M <= 4, W8A16)

GEMV_CASES = [  # N, K, group_n, group_k, bias
    (80, 48, 32, 32, True),    # partial N and K blocks: 80 = 2 * 32 + 16 rows, K = 32 + 16
    (37, 100, 1, 128, False),  # per-row scales, one scale per row (group_k >= K), K % 16 != 0
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K,gn,gk,bias", GEMV_CASES)
def test_fp8_gemv(device, dtype, M, N, K, gn, gk, bias):
    w, s = _weight(device, N, K, gn, gk)
    x, b = _x(device, dtype, M, K), _bias(device, dtype, N, bias)
    _close(fp8_gemv_triton(x, w, s, gn, gk, b), x, w, s, gn, gk, b, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [
    Fp8GemvConfig(8, 32, 1, 2),   # partial row block, 3 chunks through the cp.async ring
    Fp8GemvConfig(4, 16, 1, 1),   # one vector a chunk, plain loads
    Fp8GemvConfig(2, 128, 4, 1),  # one masked chunk covers K
])
def test_fp8_gemv_configs(device, dtype, config):
    w, s = _weight(device, 40, 96, 16, 32)
    x, b = _x(device, dtype, 3, 96), _bias(device, dtype, 40, True)
    _close(fp8_gemv_triton(x, w, s, 16, 32, b, config=config), x, w, s, 16, 32, b, None)


def test_fp8_gemv_reads_every_e4m3_code_exactly(device):
    """Every finite e4m3 code (both signs, subnormals, zero) in the columns a one-hot x selects:
    y is the weight's value times its scale, exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN
    N, K = codes.numel(), 64
    bits = torch.randint(0, 0x7F, (N, K), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    columns = (0, 1, 2, 3, 21, 63)
    bits[:, list(columns)] = codes[:, None]
    w = bits.view(fm.FP8_DTYPE).to(device)
    s = torch.full((1, 1), 0.5, device=device)
    for k in columns:
        x = torch.zeros(1, K, device=device)
        x[0, k] = 1.0
        y = fp8_gemv_triton(x, w, s, N, K, config=Fp8GemvConfig(4, 64, 1, 1))
        assert torch.equal(y[0], w[:, k].float() * 0.5), k


def test_fp8_gemv_strided_deterministic_rejects(device):
    w, s = _weight(device, 21, 64, 128, 128)
    x = _x(device, torch.float32, 5, 64)
    xs = torch.cat([x, x], dim=1)[:4, :64]  # row stride 128
    y = fp8_gemv_triton(xs, w, s, 128, 128)
    _close(y, x[:4], w, s, 128, 128, None, None)
    assert torch.equal(y, fp8_gemv_triton(x[:4].clone(), w, s, 128, 128))
    with pytest.raises(AssertionError):
        fp8_gemv_triton(x, w, s, 128, 128)  # M > 4
    w8, s8 = _weight(device, 21, 64, 128, 8)
    with pytest.raises(AssertionError):
        fp8_gemv_triton(x[:1], w8, s8, 128, 8)  # group_k < K and not a multiple of 16
    with pytest.raises(AssertionError):
        fp8_gemv_triton(x[:1], w, s8, 128, 128)  # scales of another grouping


# ----------------------------------------------------------------------------- GEMM (W8A8 and W8A16)

GEMM_CASES = [  # N, K, group_n, group_k, activation_group, bias; the weight-scale mode the launcher picks
    (80, 48, 32, 32, None, True),     # W8A16, partial N and K tiles; one scale per tile (WS_TILE)
    (40, 96, 1, 32, None, True),      # W8A16, one scale row per weight row: a scale per column and K tile
    (40, 96, 128, 128, None, False),  # W8A16, one [128, 128] block larger than the weight (WS_CHANNEL)
    (80, 96, 32, 32, 32, False),      # W8A8, three K tiles of one group each (WS_TILE)
    (40, 96, 1, 32, 32, True),        # W8A8, one scale row per weight row
    (80, 96, 1, 128, 32, True),       # W8A8, per-output-channel weight scales, group_k >= K (WS_CHANNEL)
]


def _gemm(x, w, s, gn, gk, ag, b, **kw):
    if ag is None:
        return fp8_gemm_triton(x, None, w, s, gn, gk, None, b, **kw)
    x_q, x_scale = quantize_activation_triton(x, ag)
    return fp8_gemm_triton(x_q, x_scale, w, s, gn, gk, ag, b, out_dtype=x.dtype, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [5, 17, 40])
@pytest.mark.parametrize("N,K,gn,gk,ag,bias", GEMM_CASES)
def test_fp8_gemm(device, dtype, M, N, K, gn, gk, ag, bias):
    w, s = _weight(device, N, K, gn, gk)
    x, b = _x(device, dtype, M, K), _bias(device, dtype, N, bias)
    _close(_gemm(x, w, s, gn, gk, ag, b), x, w, s, gn, gk, b, ag, weight_rounded=ag is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ag", [None, 16])
def test_fp8_gemm_small_tiles_and_swizzle(device, dtype, ag):
    # 3 x 3 tiles of 16 x 32 with GROUP_M 2 (a partial group of row tiles), 3 K tiles of 16 (the
    # config's 64 shrunk to the groups), scale rows of 16 weight rows: two per column tile
    M, N, K = 40, 80, 48
    w, s = _weight(device, N, K, 16, 16)
    x, b = _x(device, dtype, M, K), _bias(device, dtype, N, True)
    config = Fp8GemmConfig(16, 32, 64, 2, 4, 2)
    y = _gemm(x, w, s, 16, 16, ag, b, config=config)
    _close(y, x, w, s, 16, 16, b, ag, weight_rounded=ag is None)
    x_strided = torch.cat([x, x], dim=1)[:, :K]  # row stride 2 K; the same result, bit for bit
    assert torch.equal(y, _gemm(x_strided, w, s, 16, 16, ag, b, config=config))


def test_fp8_gemm_rejects(device):
    w, s = _weight(device, 16, 64, 16, 32)
    x = _x(device, torch.float32, 8, 64)
    with pytest.raises(AssertionError):
        fp8_gemm_triton(x, None, w, s, 16, 32, 32)  # W8A16 takes no activation_group
    with pytest.raises(AssertionError):
        fp8_gemm_triton(x.to(fm.FP8_DTYPE), None, w, s, 16, 32, 32)  # W8A8 needs x_scale


def test_gemm_config_rule():
    for w8a8 in (True, False):
        for M in (5, 16, 17, 64, 65, 256, 257, 1024, 4096, 16384):
            for N, K in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (3072, 4096), (4096, 2048)]:
                cfg = fp8_gemm_config(M, N, K, w8a8)
                assert cfg == fp8_gemm_config(M, N, K, w8a8) and isinstance(cfg, Fp8GemmConfig)
                assert all(b & (b - 1) == 0 for b in (cfg.block_m, cfg.block_n, cfg.block_k))
                assert cfg.block_k == 128 or not w8a8  # a [128, 128] block's depth
                tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
                assert tiles >= 132 or cfg.block_n == 32, (M, N, cfg)
                x_bytes = 1 if w8a8 else 2
                smem = cfg.num_stages * cfg.block_k * (cfg.block_m * x_bytes + cfg.block_n)
                assert smem <= 200 * 1024, cfg  # H200: 227 KiB a block
    assert fp8_gemm_config(4096, 4096, 4096) == Fp8GemmConfig(128, 128, 128, 8, 8, 4)
    assert fp8_gemm_config(8, 4096, 4096) == Fp8GemmConfig(16, 32, 128, 1, 2, 4)  # 128 tiles, floor 32
    assert fp8_gemm_config(40, 80, 48) == Fp8GemmConfig(64, 32, 64, 1, 4, 4)  # capped at tiny shapes
    assert block_k_for_groups(128, 4096, 128, 128) == 128
    assert block_k_for_groups(128, 4096, 4096, 32) == 32  # per-channel weight, activation groups of 32
    assert block_k_for_groups(128, 96, 48, None) == 16  # 48's largest power-of-two divisor
    assert groups_supported(100, 128, None) and groups_supported(96, 48, 32) and not groups_supported(96, 24, None)


def test_gemv_config_rule():
    for M in (1, 2, 3, 4):
        for N, K in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (3072, 4096), (37, 100)]:
            cfg = fp8_gemv_config(M, N, K)
            assert cfg == fp8_gemv_config(M, N, K) and cfg.block_k & (cfg.block_k - 1) == 0
            assert cfg.block_n == 1 or -(-N // cfg.block_n) >= 4 * 132  # >= 4 programs per SM
            assert cfg.block_k >= 16 * 32 * cfg.num_warps or cfg.num_warps == 1  # warps along K
    assert fp8_gemv_config(1, 4096, 4096) == Fp8GemvConfig(4, 4096, 8, 1)  # 16 KiB a program
    assert fp8_gemv_config(2, 4096, 4096) == Fp8GemvConfig(4, 1024, 2, 3)
    assert fp8_gemv_config(4, 24576, 4096) == Fp8GemvConfig(4, 2048, 4, 3)
    assert fp8_gemv_config(1, 37, 100) == Fp8GemvConfig(1, 128, 1, 1)


# ----------------------------------------------------------------------------- the dispatcher

def test_fp8_linear_reference_path():
    # CPU tensors take the reference (even under the interpreter), as does kernel_path("reference")
    w, s = _weight("cpu", 48, 64, 16, 32)
    x, b = _x("cpu", torch.bfloat16, 6, 64).view(2, 3, 64), _bias("cpu", torch.bfloat16, 48, True)
    y = fp8_linear(x, w, s, 16, 32, b, activation_group=32)
    assert torch.equal(y, fm.fp8_linear_reference(x, w, s, 16, 32, b, 32))
    with kernel_path("reference"):
        assert torch.equal(fp8_linear(x, w, s, 16, 32, b, 32), y)


@pytest.mark.parametrize("rows,ag", [(1, 32), (3, 32), (3, None), (6, 32), (6, None)])
def test_fp8_linear_triton_paths(device, rows, ag):
    # one row, or <= 4 without an activation_group: the GEMV (W8A16); more: quantize + W8A8, or W8A16
    w, s = _weight(device, 48, 64, 16, 32)
    x, b = _x(device, torch.float32, rows, 64), _bias(device, torch.float32, 48, True)
    with kernel_path("kernels"):
        y = fp8_linear(x.view(1, rows, 64), w, s, 16, 32, b, activation_group=ag)
    assert y.shape == (1, rows, 48)
    _close(y.view(rows, 48), x, w, s, 16, 32, b, ag if rows > 1 else None)  # float32: no weight rounding


def test_fp8_linear_unsupported_groups_fall_back(device, caplog):
    w, s = _weight(device, 48, 72, 16, 24)
    x = _x(device, torch.float32, 6, 72)
    with kernel_path("kernels"), caplog.at_level(logging.WARNING, logger="metrale.kernels.fp8_linear"):
        y = fp8_linear(x, w, s, 16, 24)
        fp8_linear(x, w, s, 16, 24)
    assert torch.equal(y, fm.fp8_linear_reference(x, w, s, 16, 24))
    assert sum("group_k 24" in r.getMessage() for r in caplog.records) == 1  # once per process


# ----------------------------------------------------------------------------- real shapes (GPU)

# Qwen3-8B projections (N, K), [128, 128] blocks as its FP8 checkpoint has them.
REAL_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", REAL_SHAPES)
@pytest.mark.parametrize("M,ag", [(1, 128), (4, 128), (16, 128), (100, 128), (1000, 128), (1000, None)])
def test_fp8_linear_gpu(N, K, M, ag):
    w, s = _weight("cuda", N, K, 128, 128)
    x = _x("cuda", torch.bfloat16, M, K)
    y = fp8_linear(x, w, s, 128, 128, activation_group=ag)
    _close(y, x, w, s, 128, 128, None, ag if M > 1 else None, weight_rounded=M > 4 and ag is None)
    assert torch.equal(y, fp8_linear(x, w, s, 128, 128, activation_group=ag))  # bitwise reproducible
    if M > 1 and ag is not None:
        _assert_bitwise(*quantize_activation(x, ag), *fm.quantize_activation(x, ag))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_gemm_gemv_gpu_tails(dtype):
    # N, K tails at real sizes, per-row scales with activation groups of 128
    N, K = 4100, 4112
    w, s = _weight("cuda", N, K, 1, 128)
    b = _bias("cuda", dtype, N, True)
    for M, ag in ((3, None), (33, None), (33, 128), (300, 128)):
        x = _x("cuda", dtype, M, K)
        y = fp8_gemv_triton(x, w, s, 1, 128, b) if M <= 4 else _gemm(x, w, s, 1, 128, ag, b)
        _close(y, x, w, s, 1, 128, b, ag, weight_rounded=M > 4 and ag is None)


@pytest.mark.gpu
def test_fp8_linear_gpu_pdl():
    # With programmatic dependent launch the GEMV prefetches its first weight chunk before
    # waiting, and every kernel waits before reading x: the same results, bit for bit.
    w, s = _weight("cuda", 6144, 4096, 128, 128)
    xs = [_x("cuda", torch.bfloat16, M, 4096) for M in (1, 4, 100)]
    plain = [fp8_linear(x, w, s, 128, 128, activation_group=128) for x in xs]
    set_programmatic_launch(True)
    try:
        for x, y in zip(xs, plain):
            assert torch.equal(fp8_linear(x, w, s, 128, 128, activation_group=128), y)
    finally:
        set_programmatic_launch(False)
