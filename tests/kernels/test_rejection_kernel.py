"""The Triton rejection sampler (kernels/rejection_sampling.py) against the PyTorch reference
(executor/rejection_sampler.py) on the CPU interpreter: the same accepted counts and tokens for
greedy requests and for seeded sampled ones (temperature, top-k, top-p, min-p, penalties), mixed
in one batch, over a vocabulary of several chunks; the counter-based streams agree bit for bit."""

import pytest
import torch

from metrale.executor.rejection_sampler import verify_drafts_reference, verify_drafts_triton
from metrale.executor.sampler import SamplingRow
from metrale.kernels import tl, triton
from metrale.kernels import rejection_sampling as R
from metrale.messages.sampling_params import SamplingParams

CHUNK = 256  # vocabulary entries per chunk program here (2048 on the GPU): small, fast tests
VOCAB = 2 * CHUNK + 44  # three chunks, the last one partial


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(R, "BLOCK_V", CHUNK)


@triton.jit
def _uniforms_kernel(key_ptr, out_ptr, n, BLOCK: tl.constexpr):
    e = tl.arange(0, BLOCK)
    tl.store(out_ptr + e, R._uniforms_tl(tl.load(key_ptr), e), mask=e < n)


def test_counter_uniforms_match_the_kernels_bit_for_bit(device):
    from metrale.executor.sampler import stream_seed

    for key in (stream_seed(7, 3), stream_seed(2**40 + 5, 0), 2**64 - 1, 0):
        out = torch.empty(64, device=device)
        _uniforms_kernel[(1,)](torch.tensor([key - 2**64 if key >= 2**63 else key], device=device), out, 64, BLOCK=64)
        expected = R.counter_uniforms(key, torch.arange(64, device=device))
        assert torch.equal(out, expected)
        assert bool((expected > 0).all() and (expected < 1).all())


def _batch(device, params_list, seed=0, num_drafts=(3, 1, 4, 2)):
    """Logits whose argmax the drafts often follow (so chains of acceptances happen), and drafts
    that are the argmax, a likely token or a random one."""
    g = torch.Generator().manual_seed(seed)
    rows, drafts, blocks = [], [], []
    for i, (params, k) in enumerate(zip(params_list, num_drafts)):
        logits = torch.randn(k + 1, VOCAB, generator=g) * 3
        hot = torch.randint(0, VOCAB, (k + 1,), generator=g)
        logits[torch.arange(k + 1), hot] += 12.0  # a peaked target
        draft = [int(hot[j]) if (i + j) % 3 else int(torch.randint(0, VOCAB, (1,), generator=g)) for j in range(k)]
        rows.append(SamplingRow(params, 1000 + 17 * i + seed, [5, 9, 11, 5], 2))
        drafts.append(draft)
        blocks.append(logits)
    return torch.cat(blocks).to(device), rows, drafts


def _check(logits, rows, drafts):
    got = verify_drafts_triton(logits.clone(), rows, drafts)
    want = verify_drafts_reference(logits.clone(), rows, drafts)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    return want


def test_greedy_matches_the_reference(device):
    greedy = SamplingParams(temperature=0)
    accepted = []
    for seed in range(3):
        logits, rows, drafts = _batch(device, [greedy] * 4, seed)
        accepted += _check(logits, rows, drafts)[0].tolist()
    assert max(accepted) > 0 and min(accepted) < 4  # some chains accepted, some cut


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
    SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5),
], ids=["plain", "top_k_top_p", "min_p_penalties"])
def test_seeded_sampling_matches_the_reference(device, params):
    outcomes = set()
    for seed in range(3):
        logits, rows, drafts = _batch(device, [params] * 4, seed)
        num_accepted, _ = _check(logits, rows, drafts)
        outcomes.update(zip(num_accepted.tolist(), [len(d) for d in drafts]))
    assert any(n > 0 for n, _ in outcomes) and any(n < k for n, k in outcomes)


def test_greedy_and_sampled_requests_in_one_batch(device):
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95),
              SamplingParams(temperature=0, frequency_penalty=0.4), SamplingParams(temperature=1.1, top_k=7)]
    logits, rows, drafts = _batch(device, params, seed=5)
    _check(logits, rows, drafts)


def test_bf16_greedy_logits_are_read_without_a_copy(device):
    logits, rows, drafts = _batch(device, [SamplingParams(temperature=0)] * 4, seed=1)
    logits = logits.to(torch.bfloat16)
    _check(logits, rows, drafts)


def test_drafts_and_output_indices_the_device_holds(device):
    """A step planned over a verify step in flight: drafts the device holds and output indices it
    corrects (the drafts that step accepted) give exactly what the host's own drafts and indices
    give, the Triton kernel's streams hashed on the device and the reference's on the host."""
    from metrale.executor.rejection_sampler import verify_drafts
    from metrale.executor.sampler import stream_seed, stream_seeds
    from metrale.kernels import kernel_path
    from metrale.messages.scheduler_output import PLACEHOLDER

    seeds = torch.tensor([3, 2**62 + 7, 11])
    indices = torch.tensor([0, 5, 2**20])
    assert stream_seeds(seeds, indices).tolist() == [
        (lambda v: v - 2**64 if v >= 2**63 else v)(stream_seed(s, i)) for s, i in zip(seeds.tolist(), indices.tolist())]
    torch.manual_seed(0)
    drafts = [[4, 9, 1], [7], [2, 2]]
    shifts = [2, 0, 1]
    params = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=0.6, top_k=30),
              SamplingParams(temperature=0)]
    base = [SamplingRow(p, seed, [1, 2, 3] + [5] * i, 3) for i, (p, seed) in enumerate(zip(params, (5, 6, 7)))]
    shifted = [SamplingRow(r.params, r.seed, r.token_ids, r.num_prompt_tokens, index_shift=s) for r, s in zip(base, shifts)]
    for trial in range(3):
        logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB, device=device) * 3
        for i, d in enumerate(drafts):  # make the drafts likely enough that some are accepted
            start = sum(len(x) + 1 for x in drafts[:i])
            logits[start + torch.arange(len(d)), torch.tensor(d)] += 4.0
        device_drafts = torch.tensor([d + [-1] * (3 - len(d)) for d in drafts], device=device)
        for path in ("reference", "kernels"):
            with kernel_path(path):
                want = verify_drafts(logits.clone(), shifted, drafts)
                got = verify_drafts(logits.clone(), base, [[PLACEHOLDER] * len(d) for d in drafts], None,
                                    device_drafts, torch.tensor(shifts, device=device))
            assert [t.tolist() for t in got] == [t.tolist() for t in want], (trial, path)
