"""The gated delta rule kernels (metrale/kernels/gated_delta_rule.py) against the PyTorch
reference: varlen prefill batches mixing continued and fresh sequences (fresh slots hold NaN,
which must not be read) with lengths around the 64-token chunk (1, 63, 64, 65, 130) and an empty
one, GQA, q/k/v as strided views of one conv output, fp32/bf16 inputs and fp32/bf16 states,
untouched slots; the decode step with its fused gating (padding rows included); the gating."""

import pytest
import torch

from metrale.kernels import gated_delta_rule as gdr
from metrale.kernels import gated_delta_step as gds
from metrale.kernels import reference_linear_attention as ref


def _params(heads, g, device):
    # A = -exp(A) from an A as checkpoints hold it, and dt_bias: decays exp(g) mostly in 0.5..1
    A = -(torch.rand(heads, generator=g) * 2 - 1.5).exp().to(device)
    dt_bias = (torch.randn(heads, generator=g) * 0.5).to(device)
    return A, dt_bias


def _qkv(num_tokens, key_heads, value_heads, key_dim, value_dim, dtype, device, g):
    """q, k, v as views of one [num_tokens, conv_dim + pad] buffer, as the layer splits its conv output."""
    qk_width = key_heads * key_dim
    width = 2 * qk_width + value_heads * value_dim
    y = torch.randn(num_tokens, width + 16, generator=g).to(dtype=dtype, device=device)
    q = y[:, :qk_width].view(num_tokens, key_heads, key_dim)
    k = y[:, qk_width:2 * qk_width].view(num_tokens, key_heads, key_dim)
    v = y[:, 2 * qk_width:width].view(num_tokens, value_heads, value_dim)
    return q, k, v


def _gate_inputs(num_tokens, value_heads, dtype, device, g):
    ab = torch.randn(num_tokens, 2 * value_heads + 3, generator=g).to(dtype=dtype, device=device)
    return ab[:, :value_heads], ab[:, value_heads + 3:]  # strided row views, like the ba projection's split


def _states(num_slots, value_heads, key_dim, value_dim, dtype, device, g):
    return (torch.randn(num_slots, value_heads, key_dim, value_dim, generator=g) * 0.1).to(dtype=dtype, device=device)


def _run_prefill(device, dtype, lengths, has_state, key_heads=2, value_heads=4, key_dim=16, value_dim=32,
                 state_dtype=torch.float32, seed=0, out_tol=None, state_tol=None, has_dtype=torch.bool):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    q, k, v = _qkv(num_tokens, key_heads, value_heads, key_dim, value_dim, dtype, device, gen)
    a, b = _gate_inputs(num_tokens, value_heads, dtype, device, gen)
    A, dt_bias = _params(value_heads, gen, device)
    g, beta = ref.gdn_gating(a, b, A, dt_bias)
    num_slots = len(lengths) + 3
    state = _states(num_slots, value_heads, key_dim, value_dim, state_dtype, device, gen)
    slots = torch.randperm(num_slots, generator=gen)[:len(lengths)]
    for slot, h in zip(slots.tolist(), has_state):
        if not h:
            state[slot] = float("nan")  # a fresh sequence's slot: must be ignored
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    slots_d = slots.to(torch.int32).to(device)
    has_d = torch.tensor(has_state, dtype=has_dtype, device=device)
    state_ref = state.clone()

    out = gdr.gated_delta_rule_triton(q, k, v, g, beta, state, qsl, slots_d, has_d, query_start_cpu=starts)
    expected = ref.gated_delta_rule(q, k, v, g, beta, state_ref, qsl, slots_d, has_d)
    torch.testing.assert_close(out, expected, **out_tol)
    touched = torch.zeros(num_slots, dtype=torch.bool)
    touched[slots[torch.tensor(lengths) > 0]] = True
    torch.testing.assert_close(state[touched].float(), state_ref[touched].float(), **state_tol)
    torch.testing.assert_close(state[~touched], state_ref[~touched], rtol=0, atol=0, equal_nan=True)


F32 = dict(rtol=1e-4, atol=1e-4)
# bf16: operands of the recurrence and output products are rounded to bf16 (the reference keeps fp32)
BF16_OUT = dict(rtol=3e-2, atol=3e-2)
BF16_STATE = dict(rtol=3e-2, atol=2e-2)

LENGTHS = [1, 63, 64, 0, 65, 130]
HAS_STATE = [True, False, True, True, True, False]


def test_prefill_fp32(device):
    _run_prefill(device, torch.float32, LENGTHS, HAS_STATE, out_tol=F32, state_tol=F32)


def test_prefill_bf16(device):
    _run_prefill(device, torch.bfloat16, LENGTHS, HAS_STATE, out_tol=BF16_OUT, state_tol=BF16_STATE, seed=1)


def test_prefill_bf16_state(device):
    # state stored in bf16 (fp32 math, rounded on store), no GQA, wider heads: two value blocks in
    # the state kernel, one 64-column block in the output kernel
    _run_prefill(device, torch.float32, [2, 70], [True, False], key_heads=2, value_heads=2, key_dim=32,
                 value_dim=64, state_dtype=torch.bfloat16, seed=2, out_tol=dict(rtol=1e-2, atol=1e-2),
                 state_tol=dict(rtol=1e-2, atol=1e-2))


def test_prefill_gqa_4(device):
    # four value heads per key head; 128 value columns: two programs of the output kernel; the
    # engine's int32 has_initial_state
    _run_prefill(device, torch.float32, [65, 3], [False, True], key_heads=1, value_heads=4, key_dim=16,
                 value_dim=128, seed=3, out_tol=F32, state_tol=F32, has_dtype=torch.int32)


def test_prefill_head_dim_128(device):
    # the real head dims, so the real blocking: keys and values read 64 columns at a time in stage
    # 1, four 32-column programs in stage 2, two 64-column programs in stage 3
    _run_prefill(device, torch.bfloat16, [65, 1], [False, True], key_heads=1, value_heads=2, key_dim=128,
                 value_dim=128, seed=8, out_tol=BF16_OUT, state_tol=BF16_STATE)


def test_prefill_split_equals_whole(device):
    # A prompt prefilled in two pieces (the second continuing from the state the first left)
    # gives the same outputs and state as in one piece.
    gen = torch.Generator().manual_seed(4)
    q, k, v = _qkv(150, 2, 4, 16, 32, torch.float32, device, gen)
    a, b = _gate_inputs(150, 4, torch.float32, device, gen)
    g, beta = gds.gdn_gating_triton(a, b, *_params(4, gen, device))
    state = _states(2, 4, 16, 32, torch.float32, device, gen)
    one = torch.tensor([0], dtype=torch.int32, device=device)
    fresh, cont = torch.tensor([False], device=device), torch.tensor([True], device=device)
    whole = gdr.gated_delta_rule_triton(q, k, v, g, beta, state, torch.tensor([0, 150], dtype=torch.int32,
                                        device=device), one, fresh, query_start_cpu=[0, 150])
    parts = []
    for lo, hi, has in ((0, 70, fresh), (70, 150, cont)):
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        parts.append(gdr.gated_delta_rule_triton(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state,
                                                 qsl, one + 1, has, query_start_cpu=[0, hi - lo]))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[1], state[0], rtol=1e-4, atol=1e-4)


def _run_step(device, dtype, num_seqs, key_heads=2, value_heads=4, key_dim=32, value_dim=64,
              state_dtype=torch.float32, pad_rows=(), seed=0, tol=F32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(num_seqs, key_heads, value_heads, key_dim, value_dim, dtype, device, gen)
    a, b = _gate_inputs(num_seqs, value_heads, dtype, device, gen)
    A, dt_bias = _params(value_heads, gen, device)
    num_slots = num_seqs + 2
    state = _states(num_slots, value_heads, key_dim, value_dim, state_dtype, device, gen)
    slots = torch.randperm(num_slots, generator=gen)[:num_seqs].to(torch.int32)
    state_ref = state.clone()
    real = [i for i in range(num_seqs) if i not in pad_rows]
    slots_k = slots.clone()
    slots_k[list(pad_rows)] = -1
    out = gds.gated_delta_rule_step_triton(q, k, v, a, b, A, dt_bias, state, slots_k.to(device))
    g, beta = ref.gdn_gating(a[real], b[real], A, dt_bias)
    expected = ref.gated_delta_rule_step(q[real], k[real], v[real], g, beta, state_ref, slots[real].to(device))
    torch.testing.assert_close(out[real], expected, **tol)
    assert (out[list(pad_rows)] == 0).all()
    torch.testing.assert_close(state.float(), state_ref.float(), **tol)  # the padding rows' slots untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step(device, dtype):
    tol = F32 if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    _run_step(device, dtype, num_seqs=5, tol=tol)


def test_step_head_dim_128(device):
    _run_step(device, torch.bfloat16, num_seqs=2, key_heads=1, value_heads=2, key_dim=128, value_dim=128,
              tol=dict(rtol=1e-2, atol=1e-2))


def test_step_padding_bf16_state_gqa(device):
    _run_step(device, torch.float16, num_seqs=4, key_heads=1, value_heads=4, state_dtype=torch.bfloat16,
              pad_rows=(0, 2), tol=dict(rtol=1e-2, atol=1e-2))


def test_step_matches_prefill(device):
    # The decode step equals a one-token prefill of a sequence with state (the chunked kernels).
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(3, 2, 4, 16, 32, torch.float32, device, gen)
    a, b = _gate_inputs(3, 4, torch.float32, device, gen)
    A, dt_bias = _params(4, gen, device)
    state = _states(4, 4, 16, 32, torch.float32, device, gen)
    state2 = state.clone()
    slots = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
    step = gds.gated_delta_rule_step_triton(q, k, v, a, b, A, dt_bias, state, slots)
    g, beta = gds.gdn_gating_triton(a, b, A, dt_bias)
    prefill = gdr.gated_delta_rule_triton(q, k, v, g, beta, state2, torch.arange(4, dtype=torch.int32, device=device),
                                          slots, torch.ones(3, dtype=torch.bool, device=device))  # reads qsl
    torch.testing.assert_close(step, prefill, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gating(device, dtype):
    gen = torch.Generator().manual_seed(6)
    a, b = _gate_inputs(37, 6, dtype, device, gen)
    a[0, :3] = torch.tensor([30.0, -30.0, 19.5])  # softplus' linear branch, its tiny tail, near the threshold
    A, dt_bias = _params(6, gen, device)
    g, beta = gds.gdn_gating_triton(a, b, A, dt_bias)
    g_ref, beta_ref = ref.gdn_gating(a, b, A, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-7)
    # the interpreter truncates fp32 -> bf16 instead of rounding: one ulp
    torch.testing.assert_close(beta, beta_ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


def test_cpu_dispatch_takes_the_reference():
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(2, 1, 2, 16, 16, torch.float32, "cpu", gen)
    a, b = _gate_inputs(2, 2, torch.float32, "cpu", gen)
    A, dt_bias = _params(2, gen, "cpu")
    state = _states(2, 2, 16, 16, torch.float32, "cpu", gen)
    state_ref = state.clone()
    slots = torch.tensor([1, 0], dtype=torch.int32)
    out = gds.gated_delta_rule_step(q, k, v, a, b, A, dt_bias, state, slots)
    expected = ref.gated_delta_rule_step(q, k, v, *ref.gdn_gating(a, b, A, dt_bias), state_ref, slots)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(state, state_ref, rtol=0, atol=0)


# Qwen3-Next-80B / Qwen3.5 at tp=1: 16 key heads, 32 value heads, head dims 128, bf16
@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_prefill_gpu(state_dtype):
    lengths = [1, 2000, 64, 65, 1500, 3, 500]
    _run_prefill("cuda", torch.bfloat16, lengths, [True, False, True, False, True, True, False], key_heads=16,
                 value_heads=32, key_dim=128, value_dim=128, state_dtype=state_dtype,
                 out_tol=BF16_OUT, state_tol=BF16_STATE)


@pytest.mark.gpu
def test_prefill_gpu_fp32():
    _run_prefill("cuda", torch.float32, [700, 130, 1], [False, True, True], key_heads=16, value_heads=32,
                 key_dim=128, value_dim=128, out_tol=F32, state_tol=F32)


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 64, 256])
def test_step_gpu(num_seqs):
    _run_step("cuda", torch.bfloat16, num_seqs, key_heads=16, value_heads=32, key_dim=128, value_dim=128,
              pad_rows=(0,) if num_seqs > 1 else (), tol=dict(rtol=1e-2, atol=1e-2))
