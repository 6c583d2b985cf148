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


# ----------------------------------------------------------------------------- fused prologue/epilogues


def _fused_case(device, dtype, N, K, bias, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=g).to(dtype=dtype, device=device)
    w = (torch.randn(2 * N, K, generator=g) / K ** 0.5).to(dtype=dtype, device=device)
    b = torch.randn(2 * N, generator=g).to(dtype=dtype, device=device) if bias else None
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype=dtype, device=device)
    r = torch.randn(1, N, generator=g).to(dtype=dtype, device=device)
    return x, w, b, nw, r


def _separate_kernels(x, w, b, nw, r, norm, glu, residual, **overrides):
    """The same computation by the separate Triton kernels: rms_norm, the GEMV, silu_and_mul,
    then torch's add (rounded to nearest, which the CPU interpreter's casts are not: see TOL)."""
    from metrale.kernels.activation import silu_and_mul_triton
    from metrale.kernels.rms_norm import rms_norm_triton

    if norm:
        x = rms_norm_triton(x, nw, 1e-6)
    y = gemv_triton(x, w, b, **overrides)
    if glu:
        y = silu_and_mul_triton(y)
    else:
        r = r.repeat(1, 2)
    return y + r if residual else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm,glu,residual", [(True, False, False), (False, False, True), (False, True, False),
                                               (True, True, True)])
# chunks + a tail, several whole chunks (a first pass for the norm); one partial chunk, one whole
# chunk (the norm's rstd from the chunk itself)
@pytest.mark.parametrize("K,block_k,bias", [(100, 64, True), (512, 128, False), (100, 128, False), (256, 256, True)])
def test_gemv_fusions_match_the_separate_kernels(device, dtype, norm, glu, residual, K, block_k, bias):
    x, w, b, nw, r = _fused_case(device, dtype, 37, K, bias)
    res = (r if glu else r.repeat(1, 2)) if residual else None
    got = gemv_triton(x, w, b, norm=(nw, 1e-6) if norm else None, glu=glu, residual=res, block_k=block_k)
    want = _separate_kernels(x, w, b, nw, r, norm, glu, residual, block_k=block_k)
    assert got.shape == want.shape == (1, 37 if glu else 74)
    if (dtype == torch.bfloat16 and device == "cpu") or norm:
        # one rounding step apart at most: the interpreter's bf16 casts truncate (see TOL), and
        # the norm's mean square is summed in another order than rms_norm's (rstd's last bit)
        step = {torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        torch.testing.assert_close(got, want, rtol=step, atol=step)
    else:  # the same roundings in the same order: bit-identical
        assert torch.equal(got, want)


def test_gemv_fusions_dispatch_and_fall_back(device):
    x, w, b, nw, r = _fused_case(device, torch.float32, 37, 100, True)
    fused = gemv(x, w, b, norm=(nw, 1e-6), glu=True, residual=r)
    torch.testing.assert_close(fused, _separate_kernels(x, w, b, nw, r, True, True, True), rtol=1e-6, atol=1e-6)
    x2 = torch.cat([x, x])  # two rows: the fusions are spelled out with the separate kernels
    got = gemv(x2, w, b, norm=(nw, 1e-6), glu=True, residual=torch.cat([r, r]))
    torch.testing.assert_close(got, torch.cat([fused, fused]), rtol=1e-6, atol=1e-6)
    with pytest.raises(AssertionError, match="one row"):
        gemv_triton(x2, w, b, glu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name,N,K", [("qkv", 6144, 4096), ("gate_up", 12288, 4096), ("down", 4096, 12288)])
def test_gemv_fusions_gpu_8b_shapes(name, N, K):
    # Qwen3-8B's batch-1 projections with what the layer fuses into each: on the GPU every cast
    # rounds to nearest, so the fused kernel equals the separate kernels (the norm's fp32 sum
    # order aside: a last-bit difference in rstd can move an output by one bf16 step).
    glu, norm, residual = name == "gate_up", name != "down", name == "down"
    x, w, _, nw, r = _fused_case("cuda", torch.bfloat16, N if glu else N // 2, K, False)
    if not glu:
        w = w[:N].contiguous()
        r = r.repeat(1, 2)[:, :N].contiguous() if residual else r
    res = r if residual else None
    got = gemv_triton(x, w, norm=(nw, 1e-6) if norm else None, glu=glu, residual=res)
    want = _separate_kernels(x, w, None, nw, r if glu else r[:, : N // 2], norm, glu, residual)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    assert (got != want).float().mean() < 0.01
