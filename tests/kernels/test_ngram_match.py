"""kernels/ngram_match.py: prompt lookup on the device gives the host drafter's drafts
(engine/ngram_drafter.py) for every history, the Triton kernel under the interpreter and the
PyTorch reference alike: latest occurrence of the longest suffix n-gram, drafts cut at the
history's end, -1 where nothing matches."""

import random

import pytest
import torch

from metrale.engine.ngram_drafter import NgramDrafter
from metrale.kernels import HAS_TRITON, interpret_mode
from metrale.kernels.ngram_match import ngram_drafts_reference, ngram_drafts_triton


def histories(count: int, seed: int = 0) -> list[list[int]]:
    """Random token lists over a small vocabulary (so suffixes recur), with pasted repeats."""
    rng = random.Random(seed)
    out = [[7], [7, 7], [1, 2, 1], [3, 4, 5, 3, 4]]
    for _ in range(count):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 90))]
        if len(tokens) > 10 and rng.random() < 0.7:  # paste an earlier span at the end
            a = rng.randrange(len(tokens) - 5)
            tokens += tokens[a:a + rng.randrange(2, 8)]
        out.append(tokens)
    return out


def run(fn, tokens_list, k, min_n, max_n, width=128):
    history = torch.full((len(tokens_list) + 2, width), 99, dtype=torch.int32)  # stale rows and tails
    rows = torch.randperm(len(tokens_list) + 2)[:len(tokens_list)]
    for row, tokens in zip(rows.tolist(), tokens_list):
        history[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    lengths = torch.tensor([len(t) for t in tokens_list])
    return fn(history, rows, lengths, k, min_n, max_n).tolist()


def expected(tokens_list, k, min_n, max_n):
    drafter = NgramDrafter(k, min_n, max_n)
    return [(d := drafter.propose(t)) + [-1] * (k - len(d)) for t in tokens_list]


@pytest.mark.parametrize("k, min_n, max_n", [(3, 1, 3), (4, 2, 4), (1, 1, 1), (5, 3, 3)])
def test_reference_is_the_host_drafter(k, min_n, max_n):
    cases = histories(60)
    assert run(ngram_drafts_reference, cases, k, min_n, max_n) == expected(cases, k, min_n, max_n)


@pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs triton's CPU interpreter")
@pytest.mark.parametrize("k, min_n, max_n", [(3, 1, 3), (4, 2, 4), (5, 3, 3)])
def test_kernel_is_the_host_drafter(k, min_n, max_n):
    cases = histories(25, seed=1)
    got = run(lambda *a: ngram_drafts_triton(*a, block=16), cases, k, min_n, max_n)
    assert got == expected(cases, k, min_n, max_n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_at_a_real_size_on_the_gpu():
    """256 requests of histories up to 8192 tokens over a 151,936-token vocabulary, each with an
    earlier span pasted at its end: the kernel's drafts are the reference's."""
    torch.manual_seed(0)
    rows, width, k = 256, 8193, 4
    history = torch.randint(0, 151936, (rows, width), dtype=torch.int32, device="cuda")
    lengths = torch.randint(16, width - 1, (rows,), device="cuda")
    for i, length in enumerate(lengths.tolist()):  # the last 6 tokens copy an earlier span
        start = int(torch.randint(0, length - 20, ()))
        history[i, length - 6:length] = history[i, start:start + 6].clone()
    order = torch.randperm(rows, device="cuda")
    got = ngram_drafts_triton(history, order, lengths[order], k, 2, 5)
    want = ngram_drafts_reference(history, order, lengths[order], k, 2, 5)
    assert torch.equal(got, want)
    assert (got[:, 0] >= 0).float().mean() > 0.9  # most of them matched
