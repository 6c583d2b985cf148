"""The one-launch completion of a step's inputs from the step before (kernels/step_inputs.py)
against its PyTorch reference: token and draft holes, sequences moved back by rejected drafts,
any of them absent; in the Triton interpreter on the CPU."""

import pytest
import torch

from metrale.kernels import reference
from metrale.kernels.step_inputs import fill_step_inputs_triton

BLOCK_SIZE = 4


def _step(seed: int):
    """A step of 5 sequences (query lengths 1, 5, 3, 1, 5) over the last step's 6 sampled rows."""
    g = torch.Generator().manual_seed(seed)
    query_lens = [1, 5, 3, 1, 5]
    rows = sum(query_lens)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    tables = torch.randperm(64, generator=g)[:5 * 8].view(5, 8).to(torch.int32)
    seq_lens = torch.randint(10, 25, (5,), generator=g).to(torch.int32)
    positions = torch.cat([torch.arange(int(n) - q, int(n)) for n, q in zip(seq_lens, query_lens)])
    inputs = {"input_ids": torch.randint(0, 100, (rows,), generator=g), "positions": positions,
              "slots": torch.randint(0, 256, (rows,), generator=g), "seq_lens": seq_lens, "tables": tables}
    k = 4
    last = {"tokens": torch.randint(0, 100, (6,), generator=g),
            "drafts": torch.randint(-1, 100, (6 * k,), generator=g),  # -1: a short draft, clamped
            "accepted": torch.randint(0, k + 1, (6,), generator=g)}
    # Sequences 1 and 4 were planned over 4 drafts in flight: their first row is the token that
    # step samples, the other four its drafts; sequence 2 over 2 (its first row a token).
    moved = torch.tensor([1, 2, 4])
    sources = {
        "token_holes": torch.tensor([int(starts[1]), int(starts[2]), int(starts[4]), 0]),
        "token_sources": torch.tensor([3, 0, 5, 2]),
        "draft_holes": torch.cat([torch.arange(int(starts[1]) + 1, int(starts[2])),
                                  torch.arange(int(starts[4]) + 1, int(starts[5]))]),
        "draft_sources": torch.cat([3 * k + torch.arange(4), 5 * k + torch.arange(4)]),
        "moved_seqs": moved, "moved_unverified": torch.tensor([4, 2, 4]),
        "moved_last_rows": torch.tensor([3, 0, 5]),
        "moved_rows": torch.cat([torch.arange(int(starts[s]), int(starts[s + 1])) for s in moved.tolist()]),
        "moved_row_seqs": torch.repeat_interleave(torch.arange(3), torch.tensor([5, 3, 5])),
    }
    return inputs, last, sources


_PARTS = {"tokens": ("token_holes", "token_sources"), "drafts": ("draft_holes", "draft_sources"),
          "accepted": ("moved_seqs", "moved_unverified", "moved_last_rows", "moved_rows", "moved_row_seqs")}


@pytest.mark.parametrize("parts", [("tokens", "drafts", "accepted"), ("tokens",), ("drafts", "accepted"), ()])
@pytest.mark.parametrize("block", [1024, 4])  # 4: every loop runs several iterations with a partial last one
def test_fill_matches_the_reference(device, parts, block):
    inputs, last, sources = _step(seed=len(parts) + block)
    given = {name: t for part in parts for name, t in [(part, last[part])] + [(n, sources[n]) for n in _PARTS[part]]}
    expected = {name: t.clone() for name, t in inputs.items()}
    reference.fill_step_inputs(*expected.values(), BLOCK_SIZE, **given)
    got = {name: t.clone().to(device) for name, t in inputs.items()}
    fill_step_inputs_triton(*got.values(), BLOCK_SIZE, **{n: t.to(device) for n, t in given.items()}, block=block)
    for name in inputs:
        assert torch.equal(got[name].cpu(), expected[name]), name
    if "accepted" in parts:  # the rows really moved: each moved sequence by its rejected drafts
        delta = last["accepted"][sources["moved_last_rows"]] - sources["moved_unverified"]
        assert torch.equal(expected["seq_lens"][sources["moved_seqs"]] - inputs["seq_lens"][sources["moved_seqs"]],
                           delta.to(torch.int32))
        assert (delta < 0).any()
    if "drafts" in parts:
        assert (expected["input_ids"] >= 0).all()
