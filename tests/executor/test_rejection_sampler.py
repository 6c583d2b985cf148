"""The rejection sampler against the target distribution on a toy vocabulary: greedy exact,
sampled lossless (chi-square over many seeds, after temperature, top-k and top-p), penalties
applied per position with the drafts as outputs, and no drafts == the plain sampler's draw."""

import torch

from metrale.executor.rejection_sampler import verify_drafts
from metrale.executor.sampler import SamplingRow, _filter, sample
from metrale.messages.sampling_params import SamplingParams

VOCAB = 6
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.2],
                       [0.1, 1.5, 1.4, 0.3, 0.0, -2.0],
                       [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
DRAFTS = [1, 2]  # two drafts: position 0 verifies 1, position 1 verifies 2, position 2 is the bonus
# Chi-square critical value for 5 degrees of freedom at p = 0.001: a false alarm once in 1000 runs.
CHI2_CRITICAL_DF5 = 20.52


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target gives no mass was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampled_tokens_follow_the_target_distribution():
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, max_tokens=8)
    num_seeds = 3000
    rows = [SamplingRow(params, seed, [3, 4], 2) for seed in range(num_seeds)]
    logits = LOGITS.repeat(num_seeds, 1)
    num_accepted, tokens = verify_drafts(logits, rows, [DRAFTS] * num_seeds)
    target = _filter(LOGITS.clone(), [rows[0]] * 3).softmax(dim=-1)
    # The first emitted token: the draft when accepted, else the token drawn from the residual.
    first = torch.where(num_accepted >= 1, torch.tensor(DRAFTS[0]), tokens)
    assert chi_square(torch.bincount(first, minlength=VOCAB).float(), target[0]) < CHI2_CRITICAL_DF5
    # Given the first draft accepted, the second token is distributed as position 1's target.
    given = num_accepted >= 1
    second = torch.where(num_accepted[given] >= 2, torch.tensor(DRAFTS[1]), tokens[given])
    assert chi_square(torch.bincount(second, minlength=VOCAB).float(), target[1]) < CHI2_CRITICAL_DF5
    # Both accepted: the bonus token from position 2's target (uniform over the top-k's five).
    bonus = tokens[num_accepted == 2]
    assert len(bonus) > 150  # expected 3000 p0(1) p1(2) = 196, sd 14
    assert chi_square(torch.bincount(bonus, minlength=VOCAB).float(), target[2]) < CHI2_CRITICAL_DF5
    # The acceptance rate of the first draft is its target probability.
    assert abs(float(given.float().mean()) - float(target[0, DRAFTS[0]])) < 0.04


def test_greedy_accepts_while_the_draft_is_the_argmax():
    rows = [SamplingRow(SamplingParams(temperature=0), 0, [3], 1)] * 3
    logits = LOGITS.repeat(3, 1)
    num_accepted, tokens = verify_drafts(logits, rows, [[0, 1], [0, 2], [4, 1]])
    # argmax per position: 0, 1, 0 (the first maximum of the flat row)
    assert num_accepted.tolist() == [2, 1, 0]
    assert tokens.tolist() == [0, 1, 0]


def test_penalties_see_the_drafts_as_outputs():
    # A repetition penalty that pushes a token below the rest once it appears: position 1 sees
    # draft 0 as an output, so its argmax is no longer 0.
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    row = SamplingRow(params, 0, [3], 1)
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0, 0.0, 0.0], [2.0, 1.5, 0.0, 0.0, 0.0, 0.0]])
    num_accepted, tokens = verify_drafts(logits, [row], [[0]])
    assert num_accepted.tolist() == [1] and tokens.tolist() == [1]
    expected, _ = sample(logits[1:].clone(), [SamplingRow(params, 0, [3, 0], 1)])
    assert tokens.tolist() == expected


def test_no_drafts_draws_from_the_plain_target():
    # The rejection sampler's draws come from its own counter-based streams (the kernel's), not
    # the plain sampler's generators: with no drafts its token is distributed as plain sampling's.
    params = SamplingParams(temperature=0.7, top_p=0.9)
    rows = [SamplingRow(params, seed, [1, 2, 3], 1) for seed in range(2000)]
    logits = LOGITS[:1].repeat(2000, 1)
    num_accepted, tokens = verify_drafts(logits, rows, [[]] * 2000)
    target = _filter(LOGITS[:1].clone(), rows[:1]).softmax(dim=-1)[0]
    assert num_accepted.tolist() == [0] * 2000
    assert chi_square(torch.bincount(tokens, minlength=VOCAB).float(), target) < CHI2_CRITICAL_DF5


def test_drafts_drawn_from_q_give_the_target_distribution():
    """A drafter that draws its drafts from distributions q (given to the sampler): accepted with
    min(1, p/q), else the residual max(p - q, 0): each emitted token is still distributed as the
    target's, and the first draft is accepted with probability sum(min(p, q))."""
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, max_tokens=8)
    num_seeds = 3000
    q = torch.tensor([[0.05, 0.40, 0.30, 0.10, 0.10, 0.05],
                      [0.20, 0.10, 0.50, 0.10, 0.05, 0.05]])
    generator = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(q[j], num_seeds, replacement=True, generator=generator)
                          for j in range(2)], dim=1).tolist()
    rows = [SamplingRow(params, seed, [3, 4], 2) for seed in range(num_seeds)]
    num_accepted, tokens = verify_drafts(LOGITS.repeat(num_seeds, 1), rows, drafts, [q] * num_seeds)
    target = _filter(LOGITS.clone(), [rows[0]] * 3).softmax(dim=-1)
    first_draft = torch.tensor([d[0] for d in drafts])
    first = torch.where(num_accepted >= 1, first_draft, tokens)
    assert chi_square(torch.bincount(first, minlength=VOCAB).float(), target[0]) < CHI2_CRITICAL_DF5
    given = num_accepted >= 1
    second_draft = torch.tensor([d[1] for d in drafts])[given]
    second = torch.where(num_accepted[given] >= 2, second_draft, tokens[given])
    assert chi_square(torch.bincount(second, minlength=VOCAB).float(), target[1]) < CHI2_CRITICAL_DF5
    expected_rate = float(torch.minimum(target[0], q[0]).sum())
    assert abs(float(given.float().mean()) - expected_rate) < 0.04
    # A point-mass q is the n-gram rule exactly: the same tokens as without q.
    one_hot = [torch.nn.functional.one_hot(torch.tensor(d), VOCAB).float() for d in drafts[:200]]
    assert [t.tolist() for t in verify_drafts(LOGITS.repeat(200, 1), rows[:200], drafts[:200], one_hot)] == \
        [t.tolist() for t in verify_drafts(LOGITS.repeat(200, 1), rows[:200], drafts[:200])]


def test_greedy_fast_path_equals_the_reference_on_ragged_drafts():
    from metrale.executor.rejection_sampler import verify_drafts_greedy, verify_drafts_reference

    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 1, 4, 2]
    logits = torch.randn(sum(c + 1 for c in counts), 11, generator=gen)
    argmax = logits.argmax(dim=-1).tolist()
    drafts, start = [], 0
    for i, c in enumerate(counts):  # request i's drafts match the argmax for its first i // 2
        row = [argmax[start + j] if j < i // 2 else (argmax[start + j] + 1) % 11 for j in range(c)]
        drafts.append(row)
        start += c + 1
    rows = [SamplingRow(SamplingParams(temperature=0), None, [1], 1) for _ in counts]
    fast = verify_drafts_greedy(logits, drafts)
    reference = verify_drafts_reference(logits, rows, drafts)
    assert [t.tolist() for t in fast] == [t.tolist() for t in reference]
    assert fast[0].tolist() == [0, 0, 1, 1, 2]  # some accepted, so the comparison can fail
    assert verify_drafts_greedy(logits[:2], [[], []])[1].tolist() == argmax[:2]
