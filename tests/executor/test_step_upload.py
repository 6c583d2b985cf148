"""A step's index arrays travel to the device in one copy per dtype and come back as views."""

import numpy as np
import torch

from metrale.executor.model_runner import ModelRunner


def test_upload_packs_arrays_into_views_of_one_copy():
    runner = ModelRunner.__new__(ModelRunner)  # _upload needs only the device and the pinning choice
    runner.device, runner._pin = torch.device("cpu"), False
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
    runner.device, runner._pin = torch.device("cpu"), False
    for dtype in (torch.int64, torch.int32):
        arrays = {f"a{i}": np.arange(n, dtype=np.int64) for i, n in enumerate((3, 1, 5, 0, 7))}
        views = runner._upload(arrays, dtype)
        for name, array in arrays.items():
            assert views[name].data_ptr() % 16 == 0, (dtype, name)
            assert views[name].tolist() == array.tolist()
