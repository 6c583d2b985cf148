"""The skinny tensor-core GEMM (kernels/skinny_gemm.py) against F.linear: 2..16 rows, partial
row blocks and K tails, bias, every dtype, strided rows, bitwise-repeatable. In the Triton
interpreter on the CPU at tiny shapes; on CUDA also at Qwen3-8B's shapes."""

import pytest
import torch
import torch.nn.functional as F

from metrale.kernels.skinny_gemm import skinny_config, skinny_gemm, skinny_gemm_triton

from test_gemv import TOL, _inputs  # the GEMV's tolerances and random operands


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,bias,overrides", [
    (2, 37, 100, True, {}),                                  # partial row block, a K tail
    (5, 48, 64, False, dict(block_k=32)),                    # K a multiple of the chunk: no mask
    (16, 21, 80, True, dict(block_k=32, num_stages=2)),      # every padded row real
])
def test_skinny_gemm_matches_linear(device, dtype, M, N, K, bias, overrides):
    x, w, b = _inputs(device, dtype, M, N, K, bias)
    y = skinny_gemm_triton(x, w, b, **overrides)
    assert y.shape == (M, N) and y.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=rtol, atol=atol)
    assert torch.equal(y, skinny_gemm_triton(x, w, b, **overrides))  # bitwise repeatable


def test_skinny_gemm_strided_rows_and_dispatch(device):
    x, w, _ = _inputs(device, torch.float32, 3, 21, 64, False)
    xs = torch.cat([x, x], dim=1)[:, :64]  # row stride 128
    torch.testing.assert_close(skinny_gemm_triton(xs, w, block_k=32), F.linear(xs, w), rtol=1e-5, atol=1e-5)
    # [..., K] inputs keep their leading shape; one row or more than 16 go to F.linear
    x3 = x.view(3, 1, 64)
    assert skinny_gemm(x3, w).shape == (3, 1, 21)
    big = torch.randn(17, 64, device=device)
    torch.testing.assert_close(skinny_gemm(big, w), F.linear(big, w))


def test_skinny_config_is_a_function_of_the_shape():
    assert skinny_config(4, 6144, 4096) == skinny_config(4, 6144, 4096)
    assert skinny_config(2, 64, 40).block_k == 64  # capped at K rounded up


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 12288)])
def test_skinny_gemm_gpu_shapes(M, N, K):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w, _ = _inputs("cuda", torch.bfloat16, M, N, K, False)
    ref = (x.float() @ w.float().t())
    torch.testing.assert_close(skinny_gemm_triton(x, w).float(), ref, rtol=2e-2, atol=2e-2)
