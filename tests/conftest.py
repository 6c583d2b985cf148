import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
