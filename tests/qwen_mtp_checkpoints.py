"""Tiny Qwen3-Next / Qwen3.5 checkpoints with an MTP layer in Qwen's published `mtp.*` layout
(models/qwen_mtp.py), for the MTP drafting tests (tests/models/test_mtp_qwen3_next.py,
tests/gpu/test_gpu_mtp.py): transformers writes the model (hybrid_checkpoints.py), this adds the
`mtp.*` tensors to its safetensors and `mtp_num_hidden_layers` to its config."""

from __future__ import annotations

import json
import os
import shutil

import torch

LAYERS = 2  # layer 0 Gated DeltaNet, layer 1 gated attention (the MTP layer's source)
SOURCE = f"model.layers.{LAYERS - 1}."


def write_mtp_layer(base: str, path: str, passthrough: bool = False, **config_edits) -> dict:
    """A copy of `base` with an `mtp.*` layer: the full-attention layer's tensors times 1.5 as
    mtp.layers.0, a random fc and random zero-centred norms; or (`passthrough`) fc = [0 | I], the
    layer's o_proj and down projections zero and every norm weight 0 (scale 1), so the layer's
    output is the trunk's hidden state renormalised and its draft is the target's own last token.
    Returns the MTP tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    hidden = weights["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(3)
    mtp = {name.replace(SOURCE, "mtp.layers.0."): 1.5 * t for name, t in weights.items() if name.startswith(SOURCE)}
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.15
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g) * 0.3
    if passthrough:
        mtp["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
        for name in mtp:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                mtp[name] = torch.zeros_like(mtp[name])
            elif name.endswith("norm.weight") and not name.endswith(("q_norm.weight", "k_norm.weight")):
                mtp[name] = torch.zeros_like(mtp[name])
    save_file({**weights, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "mtp_num_hidden_layers": 1, **config_edits}, f)
    return mtp


def make_qwen_mtp_checkpoint(root: str, family: str, passthrough: bool = False) -> str:
    """`root`/base: transformers' tiny `family` checkpoint (LAYERS layers, the speculative tests'
    initializer range); `root`/with_mtp: it with an MTP layer (`write_mtp_layer`). -> the latter."""
    from hybrid_checkpoints import SPEC_INITIALIZER_RANGE, make_hybrid_checkpoint

    base = make_hybrid_checkpoint(os.path.join(root, "base"), family, num_hidden_layers=LAYERS,
                                  initializer_range=SPEC_INITIALIZER_RANGE)
    write_mtp_layer(base, os.path.join(root, "with_mtp"), passthrough=passthrough)
    return os.path.join(root, "with_mtp")
