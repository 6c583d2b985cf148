import pytest
import torch

from metrale.kernels import reference
from metrale.kernels.rotary import apply_rotary_triton

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def cos_sin_cache(max_pos, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _inputs(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim, max_pos=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q and k are strided views into one fused qkv buffer, as the model produces them
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype=dtype, device=device)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g).to(device)
    return positions, q, k, qkv


def _check(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, is_neox):
    positions, q, k, qkv = _inputs(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim)
    cache = cos_sin_cache(4096, rotary_dim).to(device)
    q_ref, k_ref = reference.apply_rotary(positions, q, k, cache, rotary_dim, is_neox)
    v_before = qkv[:, num_heads + num_kv_heads:].clone()
    q_out, k_out = apply_rotary_triton(positions, q, k, cache, rotary_dim, is_neox)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(q, q_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(k, k_ref, rtol=rtol, atol=atol)
    assert torch.equal(q[..., rotary_dim:], q_ref[..., rotary_dim:])  # tail untouched
    assert torch.equal(qkv[:, num_heads + num_kv_heads:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary(device, dtype, is_neox):
    _check(device, dtype, num_tokens=5, num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=64, is_neox=is_neox)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_partial(device, is_neox):
    _check(device, torch.float16, num_tokens=3, num_heads=4, num_kv_heads=4, head_dim=128, rotary_dim=32,
           is_neox=is_neox)


def test_rotary_head_dim_256(device):
    _check(device, torch.bfloat16, num_tokens=2, num_heads=2, num_kv_heads=1, head_dim=256, rotary_dim=256,
           is_neox=True)


def test_reference_matches_hf_rotate_half():
    """The neox reference is HF Llama's `q * cos + rotate_half(q) * sin` (checked in fp32)."""
    positions, q, k, _ = _inputs("cpu", torch.float32, 6, 4, 2, 64)
    cache = cos_sin_cache(4096, 64)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    q_ref, k_ref = reference.apply_rotary(positions, q, k, cache, 64, True)
    torch.testing.assert_close(q_ref, q * cos + rotate_half(q) * sin)
    torch.testing.assert_close(k_ref, k * cos + rotate_half(k) * sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_gpu(dtype, head_dim, is_neox):
    _check("cuda", dtype, num_tokens=4096, num_heads=32, num_kv_heads=8, head_dim=head_dim, rotary_dim=head_dim,
           is_neox=is_neox)
