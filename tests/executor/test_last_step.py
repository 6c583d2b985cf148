"""executor/last_step.py: a step planned before the last one is read takes the inputs only the device
holds from that step's tensors (sampled tokens, drafts), and moves the rows of a request planned
over drafts in flight back by the drafts that step rejected, all on the device."""

import numpy as np
import pytest
import torch

from metrale.executor.last_step import LastStep
from metrale.kernels import HAS_TRITON, interpret_mode, kernel_path
from metrale.messages.scheduler_output import PLACEHOLDER as P

BLOCK = 4


@pytest.mark.parametrize("path", ["reference", pytest.param("kernels", marks=pytest.mark.skipif(
    not (HAS_TRITON and interpret_mode()), reason="needs triton's CPU interpreter"))])
def test_holes_come_from_the_last_step_and_moved_rows_go_back_by_its_rejections(path):
    """Both paths of the fix-up: the PyTorch rule, and the one-launch kernel (kernels/step_inputs.py)."""
    last = LastStep()
    # The last step sampled for a, b, d (in that order): a verified 3 drafts and accepted 1, d
    # verified 2 and accepted both, b was a plain decode row.
    last.record(["a", "b", "d"], torch.tensor([10, 20, 40]), torch.tensor([1, 0, 2]))
    last.record_drafts(torch.tensor([[11, 12, 13], [21, 22, 23], [41, 42, 43]]))
    # This step: a over its verify step (3 drafts counted as accepted): its token, then 2 drafts;
    # c, a prefill chunk the host knows; b, a plain row after its pending token; d over its
    # verify step (2 unverified), a plain row.
    ids = ["a", "c", "b", "d"]
    query_lens = np.array([3, 2, 1, 1])
    query_start = np.concatenate([[0], np.cumsum(query_lens)])
    seq_index = np.repeat(np.arange(4), query_lens)
    num_drafts = np.array([2, 0, 0, 0])
    unverified = np.array([3, 0, 0, 2])
    input_ids = np.array([P, P, P, 7, 8, P, P])
    starts = np.array([20, 0, 5, 9])  # a: 17 known + its pending token + 3 drafts counted as accepted
    positions = starts[seq_index] + np.arange(7) - query_start[:-1][seq_index]
    tables = np.array([[0, 1, 2, 3, 4, 5], [6, 7, 0, 0, 0, 0], [8, 9, 0, 0, 0, 0], [10, 11, 12, 0, 0, 0]])
    slots = tables[seq_index, positions // BLOCK] * BLOCK + positions % BLOCK
    seq_lens = starts + query_lens
    arrays = last.sources(ids, seq_index, query_start, query_lens, num_drafts, unverified, input_ids)
    dev = {name: torch.from_numpy(a.copy()) for name, a in arrays.items()}
    dev.update(input_ids=torch.from_numpy(input_ids.copy()), positions=torch.from_numpy(positions.copy()),
               slots=torch.from_numpy(slots.copy()), seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
               tables=torch.from_numpy(tables.astype(np.int32)))
    with kernel_path(path):
        last.fill(dev, BLOCK)
    assert dev["input_ids"].tolist() == [10, 11, 12, 7, 8, 20, 40]
    # a accepted 1 of 3: back by 2; d accepted both: where it was planned.
    assert dev["positions"].tolist() == [18, 19, 20, 0, 1, 5, 9]
    assert dev["seq_lens"].tolist() == [21, 2, 6, 10]
    want = tables[seq_index, dev["positions"].numpy() // BLOCK] * BLOCK + dev["positions"].numpy() % BLOCK
    assert dev["slots"].tolist() == want.tolist()


def test_nothing_to_fill_when_the_host_knows_every_input():
    last = LastStep()
    last.record(["a"], torch.tensor([3]), None)
    arrays = last.sources(["a"], np.array([0, 0]), np.array([0, 2]), np.array([2]), np.array([0]), np.array([0]),
                          np.array([4, 5]))
    assert arrays == {}
