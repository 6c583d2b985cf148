"""Speculative decoding over linear attention: a verify step keeps the state after each draft
(layers/linear_attention/draft_states.py), and once j drafts are accepted the request's slot
holds exactly the state that plain decode steps of the step's first j + 1 tokens leave.

For the Gated DeltaNet backends (PyTorch, and Triton under TRITON_INTERPRET=1) and the KDA
PyTorch backend: one step verifies a request with 3 drafts and one with 1 beside a plain decode
(and, in the mixed case, a fresh prefill chunk: the Triton backend's chunked path with the
drafted sequences redirected). The outputs of every position equal plain decoding's; for every
j in 0..k the conv and recurrent states of the slot equal the reference decode steps'; the
prefill's state and the other slots are what a step without drafts leaves.
"""

from __future__ import annotations

import pytest
import torch

from metrale.kernels import reference_kda as KDA
from metrale.kernels import reference_linear_attention as R
from metrale.layers.forward_context import DraftStates
from metrale.layers.linear_attention.backend import GDNMetadata
from metrale.layers.linear_attention.draft_states import keep_accepted_states
from metrale.layers.linear_attention.kda_torch_backend import TorchKDABackend
from metrale.layers.linear_attention.torch_backend import TorchGDNBackend, gating

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, KERNEL, K = 2, 4, 16, 16, 4, 3
CHANNELS = 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
DRAFTS = [3, 1, 0]  # per continuing sequence; a fresh prefill of PREFILL tokens follows in the mixed case
PREFILL = 5


def _backends():
    backends = [TorchGDNBackend()]
    try:
        from metrale.layers.linear_attention.triton_backend import TritonGDNBackend
    except ImportError:  # no triton: the reference alone
        return backends
    return backends + [TritonGDNBackend()]


class Step:
    """One verify step's inputs: slots 0..3 for the requests, 4.. scratch rows, the padding slot last."""

    def __init__(self, mixed: bool, kda: bool = False, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.lengths = [1 + d for d in DRAFTS] + ([PREFILL] if mixed else [])
        self.drafts = DRAFTS + ([0] if mixed else [])
        n, tokens = len(self.lengths), sum(self.lengths)
        self.num_slots = 4 + 4 * K + 1
        self.slots = [2, 0, 3, 1][:n]
        heads = VALUE_HEADS if not kda else KEY_HEADS  # value heads (KDA: one head count)
        self.conv_storage = torch.randn(self.num_slots, KERNEL - 1, CHANNELS, generator=gen)  # as the layer stores it
        self.recurrent = torch.randn(self.num_slots, heads, KEY_DIM, VALUE_DIM if not kda else KEY_DIM,
                                     generator=gen) * 0.1
        self.x = torch.randn(tokens, CHANNELS + 8, generator=gen)[:, :CHANNELS]  # strided rows, as in_proj's split
        self.weight = torch.randn(CHANNELS, KERNEL, generator=gen) * 0.5
        self.q = torch.randn(tokens, KEY_HEADS, KEY_DIM, generator=gen)
        self.k = torch.randn(tokens, KEY_HEADS, KEY_DIM, generator=gen)
        self.v = torch.randn(tokens, heads, VALUE_DIM if not kda else KEY_DIM, generator=gen)
        self.a = torch.randn(tokens, VALUE_HEADS, generator=gen)
        self.b = torch.randn(tokens, VALUE_HEADS, generator=gen)
        self.A = -(torch.rand(VALUE_HEADS, generator=gen) * 2 - 1.5).exp()
        self.dt_bias = torch.randn(VALUE_HEADS, generator=gen) * 0.5
        self.g = -torch.rand(tokens, heads, KEY_DIM, generator=gen)  # KDA's per-channel log decay
        self.beta = torch.rand(tokens, heads, generator=gen)
        starts = [0]
        for length in self.lengths:
            starts.append(starts[-1] + length)
        self.starts = starts
        has_state = [1] * len(DRAFTS) + ([0] if mixed else [])
        rows = [[4 + i * K + j if j < d else self.num_slots - 1 for j in range(K)] for i, d in enumerate(self.drafts)]
        drafted = [i for i, d in enumerate(self.drafts) if d]
        self.metadata = GDNMetadata(
            torch.tensor(starts, dtype=torch.int32), torch.tensor(self.slots, dtype=torch.int32),
            torch.tensor(has_state, dtype=torch.int32), False, starts,
            DraftStates(torch.tensor(self.drafts, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32),
                        torch.tensor(drafted), K, not mixed))

    @property
    def conv_state(self):
        return self.conv_storage.transpose(1, 2)

    def keep(self, num_accepted: list[int]):
        d = self.metadata.drafts
        keep_accepted_states([self.conv_storage, self.recurrent], self.metadata.state_slots[d.drafted],
                             d.state_rows[d.drafted], d.num_drafts[d.drafted], torch.tensor(num_accepted))


def _plain_decode(step: Step, i: int, conv, recurrent, kda: bool = False):
    """Sequence i's tokens as consecutive one-token decode steps of the reference: (outputs of
    the conv, of the delta rule, and the states after each token)."""
    slot = torch.tensor([step.slots[i]], dtype=torch.int32)
    conv_outs, outs, states = [], [], []
    for t in range(step.starts[i], step.starts[i + 1]):
        conv_outs.append(R.causal_conv1d_step(step.x[t:t + 1], step.weight, None, conv, slot))
        if kda:
            outs.append(KDA.kimi_delta_rule_step(step.q[t:t + 1], step.k[t:t + 1], step.v[t:t + 1], step.g[t:t + 1],
                                                 step.beta[t:t + 1], recurrent, slot))
        else:
            g, beta = gating(step.a[t:t + 1], step.b[t:t + 1], step.A, step.dt_bias)
            outs.append(R.gated_delta_rule_step(step.q[t:t + 1], step.k[t:t + 1], step.v[t:t + 1], g, beta,
                                                recurrent, slot))
        states.append((conv[step.slots[i]].clone(), recurrent[step.slots[i]].clone()))
    return torch.cat(conv_outs), torch.cat(outs), states


def _check(step: Step, run, kda: bool, tol: float):
    initial = (step.conv_storage.clone(), step.recurrent.clone())
    conv_out, out = run(step)
    after_step = (step.conv_storage.clone(), step.recurrent.clone())
    for i, d in enumerate(DRAFTS):
        conv_ref, rec_ref = initial[0].transpose(1, 2).clone(), initial[1].clone()
        conv_outs, outs, states = _plain_decode(step, i, conv_ref, rec_ref, kda)
        rows = slice(step.starts[i], step.starts[i + 1])
        torch.testing.assert_close(conv_out[rows], conv_outs, atol=tol, rtol=tol)
        torch.testing.assert_close(out[rows], outs, atol=tol, rtol=tol)
        for j in range(d + 1):  # j drafts accepted: the state after the step's first j + 1 tokens
            step.conv_storage.copy_(after_step[0])
            step.recurrent.copy_(after_step[1])
            step.keep([min(j, n) for n in DRAFTS if n])
            slot = step.slots[i]
            torch.testing.assert_close(step.conv_state[slot], states[j][0], atol=tol, rtol=tol)
            torch.testing.assert_close(step.recurrent[slot], states[j][1], atol=tol, rtol=tol)
    if len(step.lengths) > len(DRAFTS):  # the fresh prefill: as a step without drafts leaves it
        conv_ref, rec_ref = initial[0].transpose(1, 2).clone(), initial[1].clone()
        rows = slice(step.starts[-2], step.starts[-1])
        qsl, slot, fresh = torch.tensor([0, PREFILL], dtype=torch.int32), torch.tensor(step.slots[-1:]), torch.tensor([0])
        conv_expect = R.causal_conv1d(step.x[rows], step.weight, None, conv_ref, qsl, slot, fresh)
        g, beta = gating(step.a[rows], step.b[rows], step.A, step.dt_bias)
        expect = R.gated_delta_rule(step.q[rows], step.k[rows], step.v[rows], g, beta, rec_ref, qsl, slot, fresh)
        torch.testing.assert_close(conv_out[rows], conv_expect, atol=tol, rtol=tol)
        torch.testing.assert_close(out[rows], expect, atol=tol, rtol=tol)
        torch.testing.assert_close(after_step[0].transpose(1, 2)[step.slots[-1]], conv_ref[step.slots[-1]])
        torch.testing.assert_close(after_step[1][step.slots[-1]], rec_ref[step.slots[-1]], atol=tol, rtol=tol)


@pytest.mark.parametrize("mixed", [False, True], ids=["verifies", "beside-prefill"])
@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_gdn_state_after_j_accepted_equals_plain_decode(backend, mixed):
    def run(step: Step):
        md = step.metadata
        conv_out = backend.conv(step.x, step.weight, None, step.conv_state, md)
        out = backend.delta_rule(step.q, step.k, step.v, step.a, step.b, step.A, step.dt_bias, step.recurrent, md)
        return conv_out, out

    step = Step(mixed)
    _check(step, run, kda=False, tol=1e-5 if backend.name == "torch" else 2e-4)


@pytest.mark.parametrize("mixed", [False, True], ids=["verifies", "beside-prefill"])
def test_kda_state_after_j_accepted_equals_plain_decode(mixed):
    backend = TorchKDABackend()

    def run(step: Step):
        md = step.metadata
        return (backend.conv(step.x, step.weight, step.conv_state, md),
                backend.delta_rule(step.q, step.k, step.v, step.g, step.beta, step.recurrent, md))

    _check_kda(Step(mixed, kda=True), run)  # its fresh prefill is tested in test_kda.py


def _check_kda(step: Step, run):
    initial = (step.conv_storage.clone(), step.recurrent.clone())
    conv_out, out = run(step)
    after_step = (step.conv_storage.clone(), step.recurrent.clone())
    for i, d in enumerate(DRAFTS):
        conv_ref, rec_ref = initial[0].transpose(1, 2).clone(), initial[1].clone()
        conv_outs, outs, states = _plain_decode(step, i, conv_ref, rec_ref, kda=True)
        rows = slice(step.starts[i], step.starts[i + 1])
        torch.testing.assert_close(conv_out[rows], conv_outs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[rows], outs, atol=1e-5, rtol=1e-5)
        for j in range(d + 1):
            step.conv_storage.copy_(after_step[0])
            step.recurrent.copy_(after_step[1])
            step.keep([min(j, n) for n in DRAFTS if n])
            torch.testing.assert_close(step.conv_state[step.slots[i]], states[j][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(step.recurrent[step.slots[i]], states[j][1], atol=1e-5, rtol=1e-5)


def test_untouched_slots_keep_their_state():
    """Slots of requests not in the step, and of the plain decode's row, are not changed by the
    selection; a request with all drafts accepted keeps the state after its last one."""
    step = Step(mixed=False)
    backend = TorchGDNBackend()
    backend.conv(step.x, step.weight, None, step.conv_state, step.metadata)
    backend.delta_rule(step.q, step.k, step.v, step.a, step.b, step.A, step.dt_bias, step.recurrent, step.metadata)
    before = step.recurrent.clone()
    step.keep([3, 1])  # everything accepted
    torch.testing.assert_close(step.recurrent, before, atol=0, rtol=0)
    step.keep([0, 0])
    for slot in (3, 1):  # the plain decode's, and one not in the step
        torch.testing.assert_close(step.recurrent[slot], before[slot], atol=0, rtol=0)
    for slot in (2, 0):  # both drafted requests back to the state after their first token
        assert not torch.equal(step.recurrent[slot], before[slot])
