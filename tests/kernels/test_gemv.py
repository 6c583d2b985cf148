import pytest
import torch
import torch.nn.functional as F

from metrale.kernels.gemv import GemvConfig, gemv, gemv_config, gemv_triton

# fp32: same products, only the fp32 sum order differs. bf16/fp16: y is rounded once from an fp32
# sum, so it may differ from F.linear's by one rounding step (the CPU interpreter also truncates
# fp32->bf16 instead of rounding to nearest: one more step).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(device, dtype, M, N, K, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype=dtype, device=device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype=dtype, device=device)
    b = torch.randn(N, generator=g).to(dtype=dtype, device=device) if bias else None
    return x, w, b


def _check(device, dtype, M, N, K, bias, **overrides):
    x, w, b = _inputs(device, dtype, M, N, K, bias)
    x_copy = x.clone()
    y = gemv_triton(x, w, b, **overrides)
    assert y.shape == (M, N) and y.dtype == dtype and y.device == x.device
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=rtol, atol=atol)
    assert torch.equal(x, x_copy)
    return x, w, b, y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_default_config(device, dtype, M, bias):
    _check(device, dtype, M, 37, 100, bias)  # odd N, K not a multiple of any block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("N,K,bias,overrides", [
    (37, 100, True, dict(block_n=8, block_k=32)),                 # partial last row block, 3 K chunks + a tail
    (45, 256, False, dict(block_n=16, block_k=64, num_warps=2)),  # K a multiple of block_k: no masked chunk
    (33, 200, True, dict(block_n=4, block_k=64, num_stages=1)),   # plain-load variant of the K loop
])
def test_gemv_configs(device, dtype, M, N, K, bias, overrides):
    _check(device, dtype, M, N, K, bias, **overrides)


def test_gemv_strided_x_rows(device):
    x, w, _ = _inputs(device, torch.float32, 3, 21, 64, False)
    xs = torch.cat([x, x], dim=1)[:, :64]  # row stride 128, last dim contiguous
    torch.testing.assert_close(gemv_triton(xs, w), F.linear(xs, w), rtol=1e-5, atol=1e-5)
    xt = x.t().contiguous().t()  # column-major: copied to rows first
    torch.testing.assert_close(gemv_triton(xt, w, block_n=4, block_k=16), F.linear(xt, w), rtol=1e-5, atol=1e-5)


def test_gemv_deterministic(device):
    x, w, b = _inputs(device, torch.bfloat16, 2, 37, 100, True)
    assert torch.equal(gemv_triton(x, w, b), gemv_triton(x, w, b))


def test_gemv_rejects_bad_inputs(device):
    x, w, _ = _inputs(device, torch.float32, 5, 8, 16, False)
    with pytest.raises(AssertionError):
        gemv_triton(x, w)  # M > 4
    with pytest.raises(AssertionError):
        gemv_triton(x[:2], w[:, :8])  # K mismatch
    with pytest.raises(AssertionError):
        gemv_triton(x[:2], w.t().contiguous().t())  # weight rows not contiguous


def test_gemv_dispatch(device):
    # CPU tensors take F.linear (even under the interpreter); leading dims are flattened for Triton.
    x, w, b = _inputs(device, torch.float32, 4, 12, 32, True)
    y = gemv(x.view(2, 2, 32), w, b)
    assert y.shape == (2, 2, 12)
    torch.testing.assert_close(y.view(4, 12), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x8 = torch.cat([x, x])  # 8 rows: always F.linear
    torch.testing.assert_close(gemv(x8, w, b), F.linear(x8, w, b), rtol=1e-5, atol=1e-5)


def test_gemv_config_rule():
    for M in (1, 2, 3, 4):
        for N, K in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096),
                     (3072, 4096), (4096, 2048), (12288, 4096), (4096, 6144), (37, 100)]:
            cfg = gemv_config(M, N, K, torch.bfloat16)
            assert isinstance(cfg, GemvConfig) and cfg == gemv_config(M, N, K, torch.bfloat16)
            assert cfg.block_n in (1, 2, 4) and cfg.block_k & (cfg.block_k - 1) == 0
            assert cfg.block_n == 1 or -(-N // cfg.block_n) >= 4 * 132  # >= 4 programs per SM
            assert cfg.block_k >= 8 * 32 * cfg.num_warps or cfg.num_warps == 1  # warps along K
    assert gemv_config(1, 4096, 4096, torch.float32).block_k == 2048  # 8 KiB per row chunk
    assert gemv_config(1, 4096, 4096) == GemvConfig(1, 4096, 8, 1)  # a whole row at once
    assert gemv_config(1, 37, 100) == GemvConfig(1, 128, 1, 1)  # chunk capped at K's power of two
    assert gemv_config(2, 4096, 4096) == GemvConfig(4, 512, 2, 3)
    assert gemv_config(4, 4096, 4096) == GemvConfig(4, 256, 1, 3)


# ----------------------------------------------------------------------------- real shapes (GPU)

# Qwen3-8B decode projections (N, K), then their tp=2 halves.
REAL_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096),
               (3072, 4096), (4096, 2048), (12288, 4096), (4096, 6144)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", REAL_SHAPES)
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gemv_gpu(N, K, M):
    x, w, _, y = _check("cuda", torch.bfloat16, M, N, K, False)
    ref = F.linear(x.float(), w.float())  # the fp32 sum, then one rounding
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3)
    assert torch.equal(y, gemv_triton(x, w))  # bitwise reproducible
    torch.testing.assert_close(gemv(x, w), y, rtol=0, atol=0)  # the dispatcher takes Triton


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("overrides", [{}, dict(num_stages=1), dict(num_stages=4, block_n=4),
                                       dict(block_n=32, block_k=2048, num_warps=8, num_stages=1)])
def test_gemv_gpu_configs_bias(dtype, overrides):
    _check("cuda", dtype, 3, 4100, 4104, True, **overrides)  # N, K tails at real sizes
