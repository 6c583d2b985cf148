"""M-RoPE through the Attention layer's fused Triton prologues (kernel_table: per-token cos/sin
rows of the step, rows 0..T-1) == the PyTorch M-RoPE rotation, with and without q/k norms, the K
write included; positions past the cos/sin cache too."""

import pytest
import torch

from metrale.kernels import kernel_path
from metrale.kernels.qk_norm_rope import rope_store_kv_triton
from metrale.layers.attention.layer import Attention
from metrale.layers.mrope import MRotaryEmbedding
from metrale.layers.norm import RMSNorm


class _Config:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.tensor([0, 1, 2, 9, 9, 9, 9, 300]), torch.tensor([0, 1, 2, 3, 3, 4, 4, 13]),
                             torch.tensor([0, 1, 2, 3, 4, 3, 4, 13])])
    q, k, v = (torch.randn(8, h, 16, generator=g) * 3 for h in (4, 2, 2))
    return positions, q, k, v


@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_norm_and_rope_take_mrope(interleaved):
    rope = MRotaryEmbedding(_Config(), 16, 64, [2, 3, 3], interleaved)
    norms = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6)
    for norm in norms:
        norm.weight.data = 1 + 0.1 * torch.randn(16)
    layer = Attention(4, 16, 0.25, 2, 0, rotary=rope, qk_norm=norms)
    positions, q, k, _ = _inputs()
    with kernel_path("reference"):
        expected = layer._norm_and_rope(positions, q.clone(), k.clone(), layer._fused_norm)
    with kernel_path("kernels"):
        got = layer._norm_and_rope(positions, q.clone(), k.clone(), layer._fused_norm)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_store_kv_takes_mrope(interleaved):
    rope = MRotaryEmbedding(_Config(), 16, 64, [2, 3, 3], interleaved)
    positions, q, k, v = _inputs(1)
    expected_q, expected_k = rope(positions, q, k)
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    slots = torch.tensor([5, 0, 3, 9, 12, 7, 1, 15])
    rows, table = rope.kernel_table(positions)
    got_q, got_k = rope_store_kv_triton(rows, q.clone(), k.clone(), v, table, 16, True,
                                        kv_cache=(k_cache, v_cache), slot_mapping=slots)
    torch.testing.assert_close(got_q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, expected_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache.view(-1, 2, 16)[slots], expected_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], v)
