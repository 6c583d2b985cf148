"""The causal conv1d kernels (metrale/kernels/causal_conv1d.py) against the PyTorch reference:
varlen batches mixing continued and fresh sequences (fresh slots hold NaN, which must not be
read), lengths below the kernel width, on a 64-token block boundary and across it, strided
inputs, untouched slots, and the decode step with padding rows."""

import pytest
import torch

from metrale.kernels import reference_linear_attention as ref
from metrale.kernels.causal_conv1d import causal_conv1d_step_triton, causal_conv1d_triton, varlen_blocks

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _inputs(device, dtype, num_tokens, channels, width, num_slots, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    # x as the conv slice of a wider projection output: rows strided, channels contiguous
    wide = torch.randn(num_tokens, channels + 24, generator=g).to(dtype=dtype, device=device)
    x = wide[:, 8:8 + channels]
    weight = (torch.randn(channels, width, generator=g) / width ** 0.5).to(dtype=dtype, device=device)
    b = (torch.randn(channels, generator=g) * 0.1).to(dtype=dtype, device=device) if bias else None
    state = torch.randn(num_slots, channels, width - 1, generator=g).to(dtype=dtype, device=device)
    return x, weight, b, state


def _run_varlen(device, dtype, lengths, has_state, channels=40, width=4, bias=True, silu=True,
                state_layout="contiguous", seed=0, has_dtype=torch.bool):
    num_slots = 2 * len(lengths) + 1
    x, weight, b, state = _inputs(device, dtype, sum(lengths), channels, width, num_slots, seed, bias)
    if state_layout == "channels_last":  # channels contiguous in memory, as some engines keep it
        state = state.transpose(1, 2).contiguous().transpose(1, 2)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed + 1))[:len(lengths)]
    has = torch.tensor(has_state, dtype=torch.bool)
    for slot, h in zip(slots.tolist(), has_state):
        if not h:
            state[slot] = float("nan")  # a fresh sequence's slot: must be ignored
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    slots_d, has_d = slots.to(torch.int32).to(device), has.to(dtype=has_dtype, device=device)
    state_ref = state.clone()

    out = causal_conv1d_triton(x, weight, b, state, qsl, slots_d, has_d, silu=silu, query_start_cpu=starts)
    expected = ref.causal_conv1d(x, weight, b, state_ref, qsl, slots_d, has_d, silu=silu)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    touched = torch.zeros(num_slots, dtype=torch.bool)
    touched[slots[torch.tensor(lengths) > 0]] = True
    torch.testing.assert_close(state[touched], state_ref[touched], **TOL[dtype])
    torch.testing.assert_close(state[~touched], state_ref[~touched], rtol=0, atol=0, equal_nan=True)


# lengths: 1 and 2 (below the width: the new state keeps part of the history), 0 (no tokens), 63,
# 64 (one full block), 65 and 130 (into a second and third block)
LENGTHS = [1, 63, 0, 64, 2, 65, 130]
HAS_STATE = [True, False, True, True, False, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_varlen(device, dtype):
    _run_varlen(device, dtype, LENGTHS, HAS_STATE)


def test_causal_conv1d_varlen_fp16_no_bias_no_silu(device):
    _run_varlen(device, torch.float16, [5, 70], [True, False], bias=False, silu=False, has_dtype=torch.int32)


def test_causal_conv1d_varlen_many_channel_blocks(device):
    # 1100 channels: two 1024-channel programs per block, the second partial; a channels-last state
    _run_varlen(device, torch.float32, [3, 66], [True, True], channels=1100, state_layout="channels_last")


@pytest.mark.parametrize("width", [2, 3])
def test_causal_conv1d_varlen_widths(device, width):
    _run_varlen(device, torch.float32, [1, 4, 65], [True, True, False], width=width)


def _run_step(device, dtype, num_seqs, channels=40, width=4, bias=True, pad_rows=(), seed=0):
    num_slots = num_seqs + 3
    x, weight, b, state = _inputs(device, dtype, num_seqs, channels, width, num_slots, seed, bias)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed + 1))[:num_seqs].to(torch.int32)
    state_ref = state.clone()
    real = [i for i in range(num_seqs) if i not in pad_rows]
    slots_k = slots.clone()
    slots_k[list(pad_rows)] = -1
    out = causal_conv1d_step_triton(x, weight, b, state, slots_k.to(device))
    expected = ref.causal_conv1d_step(x[real], weight, b, state_ref, slots[real].to(device))
    torch.testing.assert_close(out[real], expected, **TOL[dtype])
    assert (out[list(pad_rows)] == 0).all()
    torch.testing.assert_close(state, state_ref, **TOL[dtype])  # padding rows' slots untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal_conv1d_step(device, dtype):
    _run_step(device, dtype, num_seqs=5)


def test_causal_conv1d_step_padding_and_wide(device):
    _run_step(device, torch.float32, num_seqs=4, channels=1100, bias=False, pad_rows=(1, 3))


def test_causal_conv1d_step_matches_varlen(device):
    # A decode step equals a one-token extend of a sequence with state.
    x, weight, b, state = _inputs(device, torch.float32, 3, 40, 4, 4, seed=3)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    state2 = state.clone()
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    has = torch.ones(3, dtype=torch.bool, device=device)
    a = causal_conv1d_step_triton(x, weight, b, state, slots)
    c = causal_conv1d_triton(x, weight, b, state2, qsl, slots, has, query_start_cpu=[0, 1, 2, 3])
    torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, state2, rtol=0, atol=0)


def test_varlen_blocks():
    qsl = torch.tensor([0, 1, 1, 65, 200], dtype=torch.int32)
    blocks, first, n = varlen_blocks(qsl, None, 64)
    assert n == 5
    assert blocks.tolist() == [[0, 0], [2, 1], [3, 65], [3, 129], [3, 193]]
    assert first.tolist() == [0, 1, 1, 2, 5]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_conv1d_gpu(dtype):
    # Qwen3-Next-80B's conv at tp=1: 8192 channels, width 4, 4096 tokens over 6 sequences
    lengths = [1, 3000, 64, 65, 900, 66]
    _run_varlen("cuda", dtype, lengths, [True, False, True, False, True, True], channels=8192)
    _run_step("cuda", dtype, num_seqs=256, channels=8192, pad_rows=(7,))


@pytest.mark.parametrize("lengths", [[1], [1, 2], [65, 3, 7]])
def test_varlen_blocks_first_block_is_16_byte_aligned(lengths):
    """An alignment that changed with the block count would compile new kernel variants mid-serving
    (seen on an H200: the state kernel after the warm-up)."""
    from metrale.kernels.causal_conv1d import varlen_blocks

    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    blocks, first, num_blocks = varlen_blocks(qsl, None, 64)
    assert first.data_ptr() % 16 == 0 and blocks.data_ptr() % 16 == 0
    assert first.tolist()[-1] == num_blocks == sum(-(-n // 64) for n in lengths)
