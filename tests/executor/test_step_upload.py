"""A step's index arrays travel to the device in one copy per dtype and come back as views."""

import numpy as np
import torch

import pytest

from metrale.executor.host_staging import DEPTH, HostStaging
from metrale.executor.model_runner import ModelRunner


def test_upload_packs_arrays_into_views_of_one_copy():
    runner = ModelRunner.__new__(ModelRunner)  # _upload needs only the device and the pinning choice
    runner.device = torch.device("cpu")
    runner.staging = HostStaging(runner.device)
    arrays = {"ids": np.array([5, 6, 7], dtype=np.int64), "table": np.arange(6, dtype=np.int32).reshape(2, 3),
              "empty": np.zeros(0, dtype=np.int64), "lens": np.array([2**31 - 1], dtype=np.int64)}
    views = runner._upload(arrays, torch.int32)
    assert set(views) == set(arrays)
    for name, array in arrays.items():
        assert views[name].dtype == torch.int32 and tuple(views[name].shape) == array.shape
        assert views[name].tolist() == array.tolist()
    # one buffer underneath: consecutive views of the same storage
    assert views["ids"].untyped_storage().data_ptr() == views["table"].untyped_storage().data_ptr()
    wide = runner._upload({"a": np.array([2**40], dtype=np.int64)}, torch.int64)
    assert wide["a"].item() == 2**40


def test_upload_views_are_16_byte_aligned():
    """Triton compiles one kernel variant per pointer alignment: every view must start on a
    16-byte boundary whatever the lengths of the arrays before it."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.staging = HostStaging(runner.device)
    for dtype in (torch.int64, torch.int32):
        arrays = {f"a{i}": np.arange(n, dtype=np.int64) for i, n in enumerate((3, 1, 5, 0, 7))}
        views = runner._upload(arrays, dtype)
        for name, array in arrays.items():
            assert views[name].data_ptr() % 16 == 0, (dtype, name)
            assert views[name].tolist() == array.tolist()


def test_off_cuda_every_staged_buffer_is_new():
    """On the CPU `host.to(cpu)` is the host buffer itself: reusing it would rewrite what an
    earlier step still holds."""
    staging = HostStaging(torch.device("cpu"))
    first = staging.take("rows", (2, 3), torch.int64)
    assert not first.host.is_pinned() and tuple(first.host.shape) == (2, 3)
    first.host.fill_(1)
    kept = first.to(torch.device("cpu"))
    for _ in range(DEPTH + 1):
        staging.take("rows", (2, 3), torch.int64).host.fill_(2)
    assert kept.tolist() == [[1, 1, 1], [1, 1, 1]]


@pytest.mark.gpu
def test_pinned_buffers_are_reused_only_after_their_copy_ran():
    device = torch.device("cuda")
    staging = HostStaging(device)
    dests, pointers = [], set()
    torch.cuda._sleep(200_000_000)  # the copies below queue behind ~0.1 s of device work
    for step in range(3 * DEPTH):
        staged = staging.take("rows", (1000,), torch.int64)
        assert staged.host.is_pinned()
        pointers.add(staged.host.data_ptr())
        staged.host.fill_(step)  # waits for this buffer's copy of DEPTH steps ago, never overwrites it
        dest = torch.empty(1000, dtype=torch.int64, device=device)
        staged.copy_into(dest)
        dests.append(dest)
    assert len(pointers) == DEPTH  # a ring, not an allocation per step
    assert [int(d[0]) for d in dests] == list(range(3 * DEPTH))
    assert all(bool((d == d[0]).all()) for d in dests)
    grown = staging.take("rows", (5000,), torch.int64)  # larger than the ring's buffers: a new one
    assert grown.host.numel() == 5000 and grown.host.data_ptr() not in pointers
