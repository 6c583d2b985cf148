"""Stream a checkpoint's tensors from safetensors files, one tensor at a time.

Files are memory-mapped; each tensor is read, copied to its parameter and dropped, so host
memory never holds a second copy of the model. Pickle checkpoints (.bin, .pt) are refused:
loading them runs arbitrary code.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch

from metrale.config.model_config import ModelLoadError

_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def checkpoint_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index_path} is not a valid safetensors index: {e}") from None
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"the safetensors index names missing files: {', '.join(map(os.path.basename, missing))}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickles = [p for pattern in _PICKLE_PATTERNS for p in glob.glob(os.path.join(model_dir, pattern))]
    if pickles:
        raise ModelLoadError(
            f"{model_dir!r} holds only pickle checkpoints ({', '.join(sorted(map(os.path.basename, pickles)))}); "
            "met refuses them because loading pickle runs arbitrary code. Convert the checkpoint to "
            "safetensors (for example with transformers: model.save_pretrained(dir, safe_serialization=True)).")
    raise ModelLoadError(f"{model_dir!r} has no *.safetensors weights")


def _unreadable(path: str, error: Exception) -> ModelLoadError:
    return ModelLoadError(f"cannot read {path}: the file is corrupt or truncated ({error})")


def count_tensors(model_dir: str) -> int:
    """Tensors in the checkpoint, from the files' headers."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as st:
                total += len(list(st.keys()))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise _unreadable(path, e) from None
    return total


def iterate_tensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise _unreadable(path, e) from None
