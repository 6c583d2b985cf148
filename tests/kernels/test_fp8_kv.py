"""The Triton KV write and attention kernels over an fp8 (e4m3) cache, against the PyTorch
backend with the same scales (CPU interpreter without CUDA)."""

import pytest
import torch

from metrale.layers.forward_context import AttentionMetadata
from metrale.kernels import triton_available
from metrale.layers.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def test_fp8_write_decode_and_extend_match_reference():
    from metrale.kernels.kv_cache_write import write_kv_cache_triton
    from metrale.kernels.paged_attention import decode_attention_triton, extend_attention_triton

    torch.manual_seed(0)
    blocks, block_size, kv_heads, heads, dim = 8, 16, 2, 4, 64
    q_lens, seq_lens = [1, 5], [20, 37]
    k_scale, v_scale = 0.02, 0.03
    total = sum(seq_lens)
    k = torch.randn(total, kv_heads, dim, device=DEVICE)
    v = torch.randn(total, kv_heads, dim, device=DEVICE)
    tables = torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32, device=DEVICE)
    slots = torch.cat([tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                       for i, n in enumerate(seq_lens)]).to(DEVICE)
    caches = {}
    for name, write in (("triton", write_kv_cache_triton), ("torch", TorchAttentionBackend().write_kv)):
        kc = torch.zeros(blocks, block_size, kv_heads, dim, dtype=FP8, device=DEVICE)
        vc = torch.zeros_like(kc)
        write(k, v, kc, vc, slots, k_scale, v_scale)
        caches[name] = (kc, vc)
    for i in (0, 1):
        a, b = caches["triton"][i].float(), caches["torch"][i].float()
        if DEVICE == "cuda":
            assert torch.equal(a, b)
        else:  # the interpreter converts to fp8 its own way (truncating, odd subnormals): nearly all equal
            assert (a != b).float().mean() < 0.02
    kc, vc = caches["torch"]

    q = torch.randn(sum(q_lens), heads, dim, device=DEVICE)
    cu = torch.tensor([0, 1, 6], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    metadata = AttentionMetadata(slots, tables, lens, cu, max(q_lens), max(seq_lens), seq_lens, q_lens)
    expected = TorchAttentionBackend().forward(q, kc, vc, metadata, dim ** -0.5, k_scale, v_scale)
    got = extend_attention_triton(q, kc, vc, tables, cu, lens, max(q_lens), dim ** -0.5, k_scale, v_scale)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)

    decode_q = torch.randn(2, heads, dim, device=DEVICE)
    decode_md = AttentionMetadata(slots, tables, lens, torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
                                  1, max(seq_lens), seq_lens, [1, 1])
    expected = TorchAttentionBackend().forward(decode_q, kc, vc, decode_md, dim ** -0.5, k_scale, v_scale)
    for splits in (1, 3):
        got = decode_attention_triton(decode_q, kc, vc, tables, lens, dim ** -0.5, splits, k_scale, v_scale)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
