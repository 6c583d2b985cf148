import math

import pytest
import torch

from metrale.kernels import reference
from metrale.kernels.paged_attention import decode_attention_triton, extend_attention_triton

# fp32 accumulation in both; the kernel rounds P to the KV dtype before P @ V.
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


def make_batch(device, dtype, q_lens, prefix_lens, num_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    """A ragged batch over a shuffled paged cache.

    Everything the kernels must NOT read is NaN: cache slots past each sequence's
    length and a poison block that all block-table padding entries point at.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    n_blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(n_blocks) + 1
    poison = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=g).tolist()  # non-contiguous allocation
    max_blocks = max(n_blocks) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), poison, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for i, n in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(n_blocks[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        b = block_tables[i].long()[pos // block_size]
        k_cache[b, pos % block_size] = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v_cache[b, pos % block_size] = torch.randn(n, num_kv_heads, head_dim, generator=g)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def dev(t, dt=None):
        return t.to(device=device, dtype=dt or t.dtype)

    return dict(q=dev(q, dtype), k_cache=dev(k_cache, dtype), v_cache=dev(v_cache, dtype),
                block_tables=dev(block_tables), cu_seqlens_q=dev(cu),
                seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)), max_q_len=max(q_lens),
                scale=1.0 / math.sqrt(head_dim))


def check_extend(device, dtype, q_lens, prefix_lens, num_heads, num_kv_heads, head_dim, **kw):
    b = make_batch(device, dtype, q_lens, prefix_lens, num_heads, num_kv_heads, head_dim, **kw)
    out = extend_attention_triton(**b)
    ref = reference.extend_attention(**b)
    assert out.shape == b["q"].shape and out.dtype == dtype
    assert not out.isnan().any(), "read a NaN cache slot it should have skipped"
    torch.testing.assert_close(out, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])


def check_decode(device, dtype, seq_lens, num_heads, num_kv_heads, head_dim, num_kv_splits, config=None, **kw):
    b = make_batch(device, dtype, [1] * len(seq_lens), [n - 1 for n in seq_lens], num_heads, num_kv_heads,
                   head_dim, **kw)
    args = dict(q=b["q"], k_cache=b["k_cache"], v_cache=b["v_cache"], block_tables=b["block_tables"],
                seq_lens=b["seq_lens"], scale=b["scale"])
    out = decode_attention_triton(**args, num_kv_splits=num_kv_splits, config=config)
    ref = reference.decode_attention(**args)
    assert out.shape == b["q"].shape and out.dtype == dtype
    assert not out.isnan().any(), "read a NaN cache slot it should have skipped"
    torch.testing.assert_close(out, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])


# Ragged mix: decode ending mid-block, a 37-token chunk after a 13-token cached prefix,
# a fresh 5-token prefill, a decode ending exactly on a block boundary, and a chunk
# after a 100-token prefix (exercises the unmasked full-tile loop).
Q_LENS = [1, 37, 5, 1, 19]
PREFIXES = [20, 13, 0, 47, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_extend(device, dtype, num_heads, num_kv_heads):
    check_extend(device, dtype, Q_LENS, PREFIXES, num_heads, num_kv_heads, head_dim=64)


def test_extend_tile_boundaries(device):
    # first query positions just below / at / above the 64-key tile edge (unmasked-loop bound)
    check_extend(device, torch.float16, [3, 3, 3, 3, 70], [62, 63, 64, 65, 0], 8, 2, 64)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_extend_head_dims(device, head_dim):
    check_extend(device, torch.bfloat16, [1, 37], [20, 13], 4, 1, head_dim)


def test_extend_empty_sequence_and_big_blocks(device):
    # a sequence with no new tokens; block_size 64 > the kernel's key tile for D=256
    check_extend(device, torch.float16, [0, 3, 1], [5, 70, 0], 4, 2, 64, block_size=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 3])
def test_decode(device, dtype, num_heads, num_kv_heads, num_kv_splits):
    check_decode(device, dtype, [1, 21, 48, 150], num_heads, num_kv_heads, 64, num_kv_splits)


@pytest.mark.parametrize("config", [(128, 4, 2), (64, 4, 1), (32, 2, 3)])  # (keys per tile, warps, stages)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_launch_configs(device, config, num_kv_splits):
    # the tiles _decode_config picks on a GPU (the CPU's 4 "SMs" pick none of the first two)
    check_decode(device, torch.float16, [1, 21, 48, 150, 300], 8, 2, 64, num_kv_splits, config=config)


def test_decode_config_rule(monkeypatch):
    from metrale.kernels import paged_attention as A

    monkeypatch.setattr(A, "num_sms", lambda device: 132)  # an H100/H200
    gpu = torch.device("cuda", 0)  # only its type and index are read
    assert A._decode_config(128, 256, 8, 1, gpu) == (128, 4, 2)  # the batch fills the GPU, unsplit
    assert A._decode_config(128, 256, 8, 2, gpu) == (64, 4, 2)  # split: tiles must tile the splits
    assert A._decode_config(128, 32, 8, 2, gpu) == (64, 4, 2)
    assert A._decode_config(128, 1, 8, 16, gpu) == (64, 4, 1)  # batch 1: a split is a tile or two
    assert A._decode_config(128, 4, 8, 8, gpu) == (64, 4, 1)
    assert A._decode_config(256, 256, 8, 1, gpu) == (64, 4, 2)  # head_dim 256: half the keys


@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_head_dims(device, head_dim):
    check_decode(device, torch.bfloat16, [33, 150], 4, 1, head_dim, num_kv_splits=4)


def test_decode_more_splits_than_blocks(device):
    # 16 splits of a 150-key sequence: most splits are empty and must not count
    check_decode(device, torch.float16, [150, 2], 8, 1, 64, num_kv_splits=16)


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_empty_sequence(device, num_kv_splits):
    # seq_len 0 (a padded batch slot): zeros, no NaN, no out-of-range reads
    b = make_batch(device, torch.float16, [1, 1], [0, 40], 4, 2, 64)
    b["seq_lens"][0] = 0
    out = decode_attention_triton(b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"],
                                  num_kv_splits=num_kv_splits)
    ref = reference.decode_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"])
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, ref, rtol=3e-3, atol=3e-3)


def test_decode_merge_over_several_tiles_of_splits(device):
    # 40 splits of 64 keys: 19 used by the 1200-key sequence, merged 16 at a time
    check_decode(device, torch.float16, [1200, 77], 4, 2, 64, num_kv_splits=40)


def test_decode_matches_extend(device):
    b = make_batch(device, torch.float16, [1, 1, 1], [9, 64, 130], 8, 2, 64)
    dec = decode_attention_triton(b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"],
                                  num_kv_splits=2)
    ext = extend_attention_triton(**b)
    torch.testing.assert_close(dec, ext, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------- real shapes (GPU only)

GPU_CASES = [(64, 32, 8), (128, 32, 8), (128, 32, 32), (256, 16, 4), (128, 64, 8)]  # (head_dim, heads, kv_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", GPU_CASES)
def test_extend_gpu(dtype, head_dim, num_heads, num_kv_heads):
    q_lens = [1] * 24 + [37, 512, 1000, 3]
    prefixes = [100 + 97 * i for i in range(24)] + [13, 0, 2047, 4000]
    check_extend("cuda", dtype, q_lens, prefixes, num_heads, num_kv_heads, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", GPU_CASES)
@pytest.mark.parametrize("num_kv_splits", [None, 1, 7])
def test_decode_gpu(dtype, head_dim, num_heads, num_kv_heads, num_kv_splits):
    seq_lens = [1, 17, 300, 4096, 32768] + [1 + 613 * i for i in range(27)]
    check_decode("cuda", dtype, seq_lens, num_heads, num_kv_heads, head_dim, num_kv_splits)
