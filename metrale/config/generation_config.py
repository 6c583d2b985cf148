"""Sampling defaults from a checkpoint's generation_config.json, as vLLM takes them.

`--generation-config auto` (the default): the model directory's file; `vllm`: none; a directory:
the generation_config.json in it. The defaults fill what a request leaves unset, never what it
sets. Only sampling fields are taken; the end-of-sequence ids are read elsewhere (always).
"""

from __future__ import annotations

import json
import os

from metrale.config.errors import OptionError

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: str, setting: str = "auto") -> dict:
    """{SamplingParams field: value} for the fields the generation config sets."""
    if setting == "vllm":
        return {}
    folder = model_dir if setting == "auto" else setting
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if setting == "auto":
            return {}
        raise OptionError(f"--generation-config {setting}: no generation_config.json there (or pass auto / vllm)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise OptionError(f"cannot read {path}: {e}") from None
    return {field: raw[key] for key, field in SAMPLING_KEYS.items() if raw.get(key) is not None}
