import os
import sys

import torch

# Triton kernels run under its CPU interpreter when there is no GPU. The variable is read when a
# kernel is decorated, so it is set here, before any test module imports metrale.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
# MET_TEST_THREADS=1 when several pytest processes share the machine: two processes of two
# threads each on two cores slow the tiny-model tests tenfold or more.
torch.set_num_threads(int(os.environ.get("MET_TEST_THREADS", max(1, min(2, os.cpu_count() or 1)))))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """family -> path of a tiny random checkpoint (built once per session)."""
    from checkpoints import make_checkpoint

    cache = {}

    def get(family: str = "llama", **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(f"ckpt_{family}"))
            cache[key] = make_checkpoint(path, family, **overrides)
        return cache[key]

    return get
