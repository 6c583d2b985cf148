import pytest
import torch

from metrale.kernels import reference
from metrale.kernels.kv_cache_write import write_kv_cache_triton


def _run(device, dtype, num_tokens, num_kv_heads, head_dim, num_blocks, block_size, pad_every=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    # k, v as non-contiguous views of a fused qkv-like buffer (as the model produces them)
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=g).to(dtype=dtype, device=device)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::pad_every] = -1  # padding tokens: must not be written
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    reference.write_kv_cache(k, v, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache(device, dtype):
    _run(device, dtype, num_tokens=21, num_kv_heads=2, head_dim=64, num_blocks=4, block_size=16)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_write_kv_cache_head_dims(device, head_dim):
    _run(device, torch.bfloat16, num_tokens=9, num_kv_heads=1, head_dim=head_dim, num_blocks=2, block_size=16)


def test_write_kv_cache_all_padding(device):
    _run(device, torch.float16, num_tokens=3, num_kv_heads=2, head_dim=64, num_blocks=2, block_size=16, pad_every=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_write_kv_cache_gpu(dtype, head_dim):
    _run("cuda", dtype, num_tokens=4096, num_kv_heads=8, head_dim=head_dim, num_blocks=2048, block_size=16)
