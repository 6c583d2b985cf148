"""Stream a checkpoint's tensors from safetensors files, one tensor at a time.

Files are memory-mapped; each tensor is read, copied to its parameter and dropped, so host
memory never holds a second copy of the model. Pickle checkpoints (.bin, .pt) are refused:
loading them runs arbitrary code.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
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


def tensor_locations(model_dir: str) -> dict[str, tuple[str, int, int]]:
    """Every checkpoint tensor's (file, first byte, end byte), from the safetensors headers only;
    {} where the directory holds no safetensors (its loading fails on its own, later)."""
    try:
        files = checkpoint_files(model_dir)
    except ModelLoadError:
        return {}
    found = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            continue  # corrupt: the loader says so when it reads the file
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                found[name] = (path, 8 + size + start, 8 + size + end)
    return found


def sha256_of_tensors(model_dir: str, prefixes: tuple[str, ...], chunk: int = 64 << 20) -> tuple[int, str]:
    """(tensors, hex sha256) of the checkpoint tensors whose names start with `prefixes`: sorted
    by name, each its UTF-8 name then its raw bytes as stored, read from their byte ranges only."""
    locations = tensor_locations(model_dir)
    names = sorted(name for name in locations if name.startswith(prefixes))
    digest = hashlib.sha256()
    for name in names:
        path, start, end = locations[name]
        digest.update(name.encode())
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            while left:
                block = f.read(min(chunk, left))
                if not block:
                    raise _unreadable(path, EOFError(f"tensor {name} is truncated"))
                digest.update(block)
                left -= len(block)
    return len(names), digest.hexdigest()
