"""Kernel tests: Triton kernels vs the PyTorch references.

Without CUDA the kernels run in Triton's CPU interpreter at tiny shapes.
TRITON_INTERPRET must be set before any `@triton.jit` function is decorated,
i.e. before metrale.kernels.* modules are imported.
"""

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # allow running from a plain checkout (package not pip-installed)
    import metrale  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Kernel modules imported earlier in this session (e.g. by other test dirs)
# were decorated before TRITON_INTERPRET was set: re-decorate them.
for _name in [n for n in sys.modules if n.startswith("metrale.kernels.") and n != "metrale.kernels.reference"]:
    importlib.reload(sys.modules[_name])

from metrale.kernels import triton_available  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_triton = pytest.mark.skip(reason="triton is not importable (or no CUDA and TRITON_INTERPRET unset)")
    skip_gpu = pytest.mark.skip(reason="real-shape variant needs a CUDA device")
    for item in items:
        if "tests/kernels/" not in str(item.fspath).replace(os.sep, "/"):
            continue
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        elif not triton_available():
            item.add_marker(skip_triton)


@pytest.fixture
def device():
    return DEVICE
