import pytest
import torch

from metrale.kernels import reference
from metrale.kernels.activation import silu_and_mul_triton

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def _check(device, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 4).to(dtype=dtype, device=device)
    out = silu_and_mul_triton(x)
    ref = reference.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 128), (2, 3, 200), (3, 2 * 1500)])  # 1500 > one 1024 block
def test_silu_and_mul(device, dtype, shape):
    _check(device, dtype, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_gpu(dtype):
    _check("cuda", dtype, (2048, 2 * 14336))
