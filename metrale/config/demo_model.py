"""The built-in demo model: a small Llama trained on Python's own documentation, shipped in the
package so `met serve` works on a fresh machine with no download (docs/demo_model.md)."""

from __future__ import annotations

import os


def demo_model_dir() -> str:
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "demo_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"the built-in demo model is missing from {path}; reinstall met")
    return path
