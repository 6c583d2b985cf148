import math

import pytest
import torch

from metrale.kernels import reference
from metrale.kernels.sampling import sample_tokens_triton

# A 10-token distribution with well separated cumulative masses (no filter sits on a boundary):
# cumulative 0.3 0.5 0.65 0.75 0.83 0.89 0.94 0.97 0.99 1.0
PROBS = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01])
PERM = torch.tensor([7, 2, 9, 0, 4, 1, 8, 3, 6, 5])  # token ids not sorted by probability
BASE = torch.empty(10).index_put_((PERM,), PROBS.log())

# (temperature, top_k, top_p, min_p)
CONFIGS = [
    (1.0, 0, 1.0, 0.0),  # plain sampling
    (0.7, 3, 1.0, 0.0),  # temperature + top-k
    (1.0, 0, 0.7, 0.0),  # top-p: keeps 4 tokens (mass above the 4th is 0.65 < 0.7)
    (1.3, 0, 1.0, 0.3),  # min-p
    (1.0, 6, 0.9, 0.3),  # all three bind: k drops 4, p drops the 6th, min-p the 5th
    (1.0, 10, 1.0, 0.0),  # top_k == vocab: off
    (1.0, 3, 0.6, 0.0),  # top-p on the RENORMALISED top-3 (.46 .31 .23): keeps 2, not 3
]


def _params(rows, device):
    cfg = torch.tensor(rows, dtype=torch.float64)
    return dict(temperature=cfg[:, 0].float().to(device), top_k=cfg[:, 1].long().to(device),
                top_p=cfg[:, 2].float().to(device), min_p=cfg[:, 3].float().to(device))


def _draw(logits, params, seeds, offsets):
    return sample_tokens_triton(logits, **params, seeds=seeds, offsets=offsets)


def test_reference_filter_semantics():
    logits = BASE.repeat(len(CONFIGS), 1)
    probs = reference.filter_logits(logits, **_params(CONFIGS, "cpu"))
    support = [set(PERM[torch.nonzero(probs[i][PERM] > 0).flatten()].tolist()) for i in range(len(CONFIGS))]
    top = PERM.tolist()  # token ids in decreasing probability
    assert support[0] == set(top)
    assert support[1] == set(top[:3])
    assert support[2] == set(top[:4])
    # min-p 0.3 at temperature 1.3: p_i / p_max = (PROBS_i / 0.3) ** (1 / 1.3) >= 0.3
    assert support[3] == {t for t, p in zip(top, PROBS.tolist()) if (p / 0.3) ** (1 / 1.3) >= 0.3}
    # k=6 -> mass .337 .225 .169 .112 .090 .067; p=0.9 keeps 5 (above the 6th: .933);
    # min-p 0.3 drops the 5th (0.08 / 0.3 < 0.3)
    assert support[4] == set(top[:4])
    assert support[5] == set(top)
    assert support[6] == set(top[:2])
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(CONFIGS)))


def test_reference_ties_and_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0], [5.0, 1.0, 5.0, 0.0, 0.0]])
    p = _params([(1.0, 2, 1.0, 0.0), (0.0, 0, 1.0, 0.0)], "cpu")
    probs = reference.filter_logits(logits, **p)
    assert (probs[0] > 0).tolist() == [False, True, True, True, False]  # tie at the k-th value: both kept
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # greedy: first argmax
    tokens = reference.sample_tokens(logits, **p, seeds=torch.tensor([1, 2]), offsets=torch.tensor([0, 0]))
    assert tokens[0].item() in (1, 2, 3) and tokens[1].item() == 0


def test_greedy(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g)
    logits[3, [17, 200]] = 100.0  # tie: first index wins
    n = logits.shape[0]
    params = _params([(0.0, 5, 0.5, 0.1)] * n, device)  # filters are ignored when greedy
    out = _draw(logits.to(device), params, torch.arange(n).to(device), torch.zeros(n, dtype=torch.long).to(device))
    assert out.dtype == torch.int64
    assert out.cpu().tolist() == logits.argmax(-1).tolist()
    assert out[3].item() == 17


def test_distribution_matches_reference(device):
    """N draws per config (distinct offsets): every draw is in the reference support,
    and empirical frequencies match the reference probabilities."""
    n_draws = 256
    rows = [c for c in CONFIGS for _ in range(n_draws)]
    logits = BASE.repeat(len(rows), 1).to(device)
    params = _params(rows, device)
    seeds = torch.full((len(rows),), 1234, dtype=torch.int64, device=device)
    offsets = torch.arange(len(rows), dtype=torch.int64, device=device)
    out = _draw(logits, params, seeds, offsets).cpu().view(len(CONFIGS), n_draws)
    ref = reference.filter_logits(BASE.repeat(len(CONFIGS), 1), **_params(CONFIGS, "cpu"))
    for i in range(len(CONFIGS)):
        freq = torch.bincount(out[i], minlength=10).double() / n_draws
        assert (ref[i][freq > 0] > 0).all(), f"config {CONFIGS[i]}: drew a filtered token"
        p = ref[i].double()
        sigma = (p * (1 - p) / n_draws).sqrt()
        assert ((freq - p).abs() <= 4.5 * sigma + 1e-9).all(), f"config {CONFIGS[i]}: {freq} vs {p}"


def test_deterministic_and_batch_invariant(device):
    g = torch.Generator().manual_seed(1)
    n = 40
    logits = (torch.randn(n, 257, generator=g) * 3).to(device)
    rows = [CONFIGS[i % len(CONFIGS)] for i in range(n)]
    params = _params(rows, device)
    seeds = torch.randint(0, 2**62, (n,), generator=g).to(device)
    offsets = torch.randint(0, 2**40, (n,), generator=g).to(device)  # offset * vocab needs 64-bit counters
    a = _draw(logits, params, seeds, offsets)
    assert torch.equal(a, _draw(logits, params, seeds, offsets))  # deterministic
    perm = torch.randperm(n, generator=g).to(device)
    b = _draw(logits[perm], {k: v[perm] for k, v in params.items()}, seeds[perm], offsets[perm])
    assert torch.equal(b, a[perm])  # any batch order
    for i in (0, 7, 33):  # alone
        one = _draw(logits[i:i + 1], {k: v[i:i + 1] for k, v in params.items()}, seeds[i:i + 1], offsets[i:i + 1])
        assert one.item() == a[i].item()
    # the draw depends on (seed, offset): changing the offset changes some draws
    c = _draw(logits, params, seeds, offsets + 1)
    assert not torch.equal(a, c)


def test_large_vocab_filters(device):
    """Vocab larger than one 4096 block: top-k / top-p / min-p thresholds across blocks."""
    g = torch.Generator().manual_seed(2)
    vocab, n = 5000, 6
    logits = torch.randn(n, vocab, generator=g) * 2
    logits[4, [10, 4500]] = 50.0  # greedy tie across two vocab blocks: first index wins
    rows = [(1.0, 20, 1.0, 0.0), (0.8, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.5),
            (1.0, 100, 0.8, 0.05), (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0)]
    params = _params(rows, device)
    ref = reference.filter_logits(logits, **_params(rows, "cpu"))
    for offset in range(3):
        out = _draw(logits.to(device), params, torch.arange(n).to(device), torch.full((n,), offset).to(device))
        out = out.cpu()
        assert (ref.gather(1, out[:, None]) > 0).all()
        assert out[4].item() == 10


@pytest.mark.gpu
def test_sampling_gpu():
    g = torch.Generator().manual_seed(3)
    vocab, n = 151936, 256
    logits = (torch.randn(n, vocab, generator=g) * 3).cuda()
    rows = [(0.0, 0, 1.0, 0.0), (1.0, 50, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1),
            (0.9, 40, 0.95, 0.05), (1.0, 0, 1.0, 0.0)]
    rows = [rows[i % len(rows)] for i in range(n)]
    params = _params(rows, "cuda")
    seeds = torch.arange(n).cuda()
    offsets = torch.full((n,), 77).cuda()
    out = _draw(logits, params, seeds, offsets)
    ref = reference.filter_logits(logits, **params)
    assert (ref.gather(1, out[:, None]) > 0).all()
    perm = torch.randperm(n, generator=g).cuda()
    assert torch.equal(_draw(logits[perm], {k: v[perm] for k, v in params.items()}, seeds[perm], offsets[perm]),
                       out[perm])


# Rows with no top-k / top-p: what the vocab-parallel path serves.
UNFILTERED = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.3, 0, 1.0, 0.3), (0.8, 0, 1.0, 0.05)]


def _both_paths(logits, rows, device, seeds, offsets):
    """(one program per row, vocab-parallel) draws of rows without top-k / top-p; the chunked
    path with its threshold search (default flags) must agree with both."""
    from metrale.kernels.sampling import _Launch, _sample_per_row

    params = _params(rows, device)
    per_row = _sample_per_row(_Launch(logits), logits, params["temperature"], params["top_k"], params["top_p"],
                              params["min_p"], seeds, offsets, torch.empty(len(rows), dtype=torch.int64, device=device))
    any_min_p = any(r[3] > 0 for r in rows)
    parallel = sample_tokens_triton(logits, **params, seeds=seeds, offsets=offsets, any_top_k=False,
                                    any_top_p=False, any_min_p=any_min_p)
    assert torch.equal(_draw(logits, params, seeds, offsets), parallel)  # thresholds INT32_MIN: same tokens
    return per_row, parallel


@pytest.mark.parametrize("vocab", [300, 1000, 1024])  # 2, 4 and exactly 4 chunks of 256 (interpreter)
def test_vocab_parallel_path_draws_the_same_tokens(device, vocab):
    """Same token as the one-row-per-program kernel for every row without top-k / top-p:
    greedy (first index on ties, across chunks), temperature, min-p."""
    g = torch.Generator().manual_seed(4)
    n = 15
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[0, [5, vocab - 1]] = 40.0  # a greedy tie across chunks
    logits[5, [vocab - 2, vocab - 1]] = 40.0  # a greedy tie inside the last chunk
    logits[10, :] = float("-inf")
    logits[10, 7] = 0.0  # one finite logit
    rows = [UNFILTERED[i % len(UNFILTERED)] for i in range(n)]
    seeds = torch.randint(0, 2**62, (n,), generator=g).to(device)
    for offset in (0, 3, 2**35):
        offsets = torch.full((n,), offset, dtype=torch.int64).to(device)
        per_row, parallel = _both_paths(logits.to(device), rows, device, seeds, offsets)
        assert torch.equal(per_row, parallel)
        assert parallel[0].item() == 5 and parallel[5].item() == vocab - 2 and parallel[10].item() == 7


def test_vocab_parallel_path_without_min_p_skips_the_row_max(device):
    g = torch.Generator().manual_seed(5)
    n, vocab = 8, 700
    logits = (torch.randn(n, vocab, generator=g) * 2).to(device)
    rows = [UNFILTERED[i % 3] for i in range(n)]  # no min-p
    seeds, offsets = torch.arange(n).to(device), torch.arange(n).to(device)
    per_row, parallel = _both_paths(logits, rows, device, seeds, offsets)
    assert torch.equal(per_row, parallel)


def test_vocab_parallel_distribution_matches_reference(device):
    n_draws = 256
    configs = UNFILTERED[1:]
    rows = [c for c in configs for _ in range(n_draws)]
    logits = BASE.repeat(len(rows), 1).to(device)
    params = _params(rows, device)
    seeds = torch.full((len(rows),), 99, dtype=torch.int64, device=device)
    offsets = torch.arange(len(rows), dtype=torch.int64, device=device)
    out = sample_tokens_triton(logits, **params, seeds=seeds, offsets=offsets, any_top_k=False, any_top_p=False)
    out = out.cpu().view(len(configs), n_draws)
    ref = reference.filter_logits(BASE.repeat(len(configs), 1), **_params(configs, "cpu"))
    for i in range(len(configs)):
        freq = torch.bincount(out[i], minlength=10).double() / n_draws
        assert (ref[i][freq > 0] > 0).all(), f"config {configs[i]}: drew a filtered token"
        p = ref[i].double()
        assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / n_draws).sqrt() + 1e-9).all()


@pytest.mark.gpu
def test_vocab_parallel_path_gpu():
    g = torch.Generator().manual_seed(6)
    vocab = 151936
    for n in (1, 7, 256):
        logits = (torch.randn(n, vocab, generator=g) * 3).cuda()
        rows = [UNFILTERED[i % len(UNFILTERED)] for i in range(n)]
        per_row, parallel = _both_paths(logits, rows, "cuda", torch.arange(n).cuda(), torch.full((n,), 11).cuda())
        assert torch.equal(per_row, parallel)


def _keys(l: torch.Tensor) -> torch.Tensor:
    b = l.contiguous().view(torch.int32).long()
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


def test_radix_thresholds_keep_the_reference_support(device):
    _check_radix_thresholds(device, vocab=1000)  # 4 chunks of 256 under the interpreter


@pytest.mark.gpu
def test_radix_thresholds_keep_the_reference_support_gpu():
    _check_radix_thresholds("cuda", vocab=151936)


def _check_radix_thresholds(device, vocab):
    """Top-k by exact counts, ties at the k-th value kept; top-p by fixed-point masses on the
    top-k survivors: the kept set {key(l) >= t} is the reference's support, row by row."""
    from metrale.kernels.sampling import INT32_MIN, _Launch, _chunk_max_kernel, _thresholds

    g = torch.Generator().manual_seed(7)
    rows = [(1.0, 5, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.5, 0, 0.3, 0.0), (1.2, 40, 0.8, 0.0),
            (1.0, 3, 0.5, 0.0), (0.0, 5, 0.5, 0.0), (1.0, 0, 1.0, 0.0), (1.0, vocab - 1, 0.999, 0.0)]
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    logits[0, [10, 500, 900]] = 9.0  # ties at the top
    logits[1, :60] = logits[1, 60:120]  # pairs of equal values everywhere
    params = _params(rows, device)
    x = logits.to(device)
    launch = _Launch(x)
    chunk_max = torch.empty(len(rows), launch.num_chunks, dtype=torch.float32, device=device)
    from metrale.kernels.sampling import SAMPLING_EPS
    _chunk_max_kernel[launch.grid](x, chunk_max, params["temperature"], len(rows), vocab, x.stride(0),
                                   launch.num_chunks, SAMPLING_EPS, ROWS=launch.rows, BLOCK_V=launch.block_v)
    t = _thresholds(launch, x, params["temperature"], params["top_k"], params["top_p"], chunk_max, True, True).cpu()
    ref = reference.filter_logits(logits, **_params(rows, "cpu"))
    for i, (temp, top_k, top_p, _) in enumerate(rows):
        if temp == 0.0:
            assert t[i].item() == INT32_MIN  # greedy rows search nothing
            continue
        kept = _keys(logits[i] / temp) >= t[i]
        if top_p < 1.0:
            # The kernel sums exact fixed-point masses; the reference's fp32 cumulative sum over
            # a large vocabulary drifts by more than a tail token's mass. Judge against float64
            # sums, leaving free only tokens whose mass above is within rounding of top_p.
            above = _mass_above_f64(logits[i] / temp, top_k)
            settled = (above - top_p).abs() > 1e-6
            expected = above < top_p
            assert torch.equal(kept[settled], expected[settled]), f"row {i} {rows[i]}"
            assert (kept & ~expected).sum() + (expected & ~kept).sum() <= 2, f"row {i} {rows[i]}"
        else:
            assert torch.equal(kept, ref[i] > 0), f"row {i} {rows[i]}: {kept.sum()} kept vs {(ref[i] > 0).sum()}"
    assert t[7].item() == INT32_MIN  # no filter


def _mass_above_f64(l: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per token, the float64 softmax mass (over the top-k survivors) of tokens with strictly
    larger l; +inf for tokens top-k drops."""
    l = l.double()
    if 0 < top_k < l.numel():
        l = l.masked_fill(l < l.sort(descending=True).values[top_k - 1], float("-inf"))
    p = torch.softmax(l, dim=-1)
    order = l.argsort(descending=True, stable=True)
    sorted_l, sorted_p = l[order], p[order]
    before = torch.cumsum(sorted_p, 0) - sorted_p
    first = torch.searchsorted(-sorted_l, -l, side="left").clamp(max=l.numel() - 1)  # ties: their first
    return torch.where(torch.isinf(l), torch.full_like(l, float("inf")), before[first])


def test_edge_filters(device):
    """top_k 1 and a tiny top_p keep only the best token; a row with one finite logit draws it;
    a vocabulary that ends inside a chunk; a temperature just above greedy."""
    g = torch.Generator().manual_seed(8)
    vocab = 257
    logits = torch.randn(6, vocab, generator=g) * 2
    logits[2, :] = float("-inf")
    logits[2, 200] = -3.0
    rows = [(1.0, 1, 1.0, 0.0), (1.0, 0, 0.01, 0.0), (1.0, 7, 0.5, 0.0), (2e-5, 0, 0.9, 0.0), (0.9, 256, 1.0, 0.0),
            (1.0, 3, 1.0, 0.5)]
    best = logits.argmax(-1)
    params = _params(rows, device)
    for offset in range(4):
        out = _draw(logits.to(device), params, torch.arange(6).to(device), torch.full((6,), offset).to(device)).cpu()
        assert out[0] == best[0] and out[1] == best[1] and out[2] == 200 and out[3] == best[3]
        ref = reference.filter_logits(logits, **_params(rows, "cpu"))
        assert (ref.gather(1, out[:, None]) > 0).all()


@pytest.mark.parametrize("vocab", [700, 1024])
def test_per_row_and_radix_paths_draw_the_same_tokens_with_filters(device, vocab):
    """Large batches take one program per row, bisecting over the same integer counts and
    fixed-point masses as the radix select: the same thresholds, so the same tokens."""
    from metrale.kernels.sampling import _Launch, _sample_per_row

    g = torch.Generator().manual_seed(9)
    configs = CONFIGS + [(0.9, 40, 0.95, 0.05), (0.6, 0, 0.8, 0.0), (1.1, 5, 1.0, 0.0), (0.0, 5, 0.5, 0.1)]
    rows = [configs[i % len(configs)] for i in range(40)]
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    logits[3, :50] = logits[3, 50:100]  # ties everywhere in some rows
    logits[14, 100:110] = 7.0
    x = logits.to(device)
    params = _params(rows, device)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=g).to(device)
    for offset in (0, 5):
        offsets = torch.full((len(rows),), offset, dtype=torch.int64).to(device)
        per_row = _sample_per_row(_Launch(x), x, params["temperature"], params["top_k"], params["top_p"],
                                  params["min_p"], seeds, offsets, torch.empty(len(rows), dtype=torch.int64,
                                                                                device=device))
        assert torch.equal(per_row, _draw(x, params, seeds, offsets))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_draw_what_their_fp32_widening_draws(device, dtype):
    """The engine hands the sampler the LM head's logits in the model dtype: both paths widen
    them as they read, so the tokens are those of the fp32 copy, filters and greedy included."""
    from metrale.kernels.sampling import _Launch, _sample_per_row

    g = torch.Generator().manual_seed(11)
    rows = [CONFIGS[i % len(CONFIGS)] for i in range(12)] + [(0.0, 0, 1.0, 0.0)] * 2
    logits = (torch.randn(len(rows), 700, generator=g) * 3).to(dtype)
    x = logits.to(device)
    params = _params(rows, device)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=g).to(device)
    offsets = torch.arange(len(rows)).to(device)
    wide = x.float()
    assert torch.equal(_draw(x, params, seeds, offsets), _draw(wide, params, seeds, offsets))
    out = torch.empty(len(rows), dtype=torch.int64, device=device)
    per_row = _sample_per_row(_Launch(x), x, params["temperature"], params["top_k"], params["top_p"],
                              params["min_p"], seeds, offsets, out.clone())
    assert torch.equal(per_row, _sample_per_row(_Launch(wide), wide, params["temperature"], params["top_k"],
                                                params["top_p"], params["min_p"], seeds, offsets, out.clone()))


def test_per_row_kernel_skips_the_passes_of_unused_filters(device):
    """Flags off (no row uses top-k, top-p or min-p) skip the max and threshold passes and the
    min-p test: the same tokens as with every pass on."""
    from metrale.kernels.sampling import _Launch, _sample_per_row

    g = torch.Generator().manual_seed(12)
    rows = [(t, 0, 1.0, 0.0) for t in (0.0, 0.6, 1.0, 1.7)] * 3
    x = (torch.randn(len(rows), 900, generator=g) * 3).to(device)
    params = _params(rows, device)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=g).to(device)
    offsets = torch.full((len(rows),), 3, dtype=torch.int64).to(device)
    out = torch.empty(len(rows), dtype=torch.int64, device=device)
    args = (_Launch(x), x, params["temperature"], params["top_k"], params["top_p"], params["min_p"], seeds, offsets)
    every_pass = _sample_per_row(*args, out.clone())
    lean = _sample_per_row(*args, out.clone(), any_top_k=False, any_top_p=False, any_min_p=False)
    assert torch.equal(every_pass, lean)


def test_output_indices_the_device_corrects(device):
    """Rows planned over a verify step in flight: an index shift on the device draws what rows
    whose own count includes it draw, through the Triton sampler and the PyTorch path."""
    from metrale.executor.sampler import SamplingRow, sample_tokens
    from metrale.kernels import kernel_path
    from metrale.messages.sampling_params import SamplingParams

    torch.manual_seed(1)
    params = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.2, top_k=40),
              SamplingParams(temperature=0)]
    base = [SamplingRow(p, 100 + i, [1, 2] + [3] * i, 2) for i, p in enumerate(params)]
    shifts = [3, 0, 2]
    shifted = [SamplingRow(r.params, r.seed, r.token_ids, r.num_prompt_tokens, index_shift=s)
               for r, s in zip(base, shifts)]
    logits = torch.randn(3, 300, device=device)
    for path in ("reference", "kernels"):
        with kernel_path(path):
            want = sample_tokens(logits.clone(), shifted).tokens.tolist()
            got = sample_tokens(logits.clone(), base, index_shift=torch.tensor(shifts, device=device)).tokens.tolist()
        assert got == want, path
