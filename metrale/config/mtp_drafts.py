"""How many drafts MTP (next-n) drafting proposes per step when neither `num_speculative_tokens`
nor `--num-drafts` says: a default per model family, read from the checkpoint's config.json.

    DeepSeek-V3 / V3.2, GLM-4.5, GLM-5   k = num_nextn_predict_layers (the published checkpoints: 1).
                                          Each next-n layer is trained for one step further; vLLM
                                          takes k = the layer count (its n_predict) too.
    Qwen3-Next, Qwen3.5 (dense and MoE)  k = 2, chained over the one `mtp.*` layer
                                          (mtp_num_hidden_layers 1): Qwen trained the layer over
                                          several steps ("MTP: trained with multi-steps") and its
                                          deployment notes serve it with num_speculative_tokens 2.
    Llama, Qwen2, Qwen3 (dense)           k = 1: met's own `mtp.*` layout (models/qwen_mtp.py's
                                          DENSE_LAYOUT); the demo model's layer was trained for
                                          one step ahead (scripts/train_demo_mtp.py).
    anything else                         k = 1 (the drafter then refuses a checkpoint without
                                          MTP layers by name).

A larger k is the user's choice (`--num-drafts`); with `--spec-cost-model measured` the chooser
cuts it per step from the calibration table.
"""

from __future__ import annotations

import json
import os

# Families whose `mtp.*` layer Qwen trained for chained drafting, and the k they get.
QWEN_MTP_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                          "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
QWEN_MTP_DRAFTS = 2
# Families with met's dense `mtp.*` layout: one step ahead, whatever num_nextn_predict_layers says
# (more than one layer is refused by the model).
DENSE_MTP_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DENSE_MTP_DRAFTS = 1
FALLBACK_DRAFTS = 1


def default_mtp_drafts(model_dir: str | None, overrides: dict | None = None) -> int:
    """k for MTP drafting on the checkpoint at `model_dir` (config.json with `overrides`, the
    --hf-overrides fields, applied). An unreadable config gives the fallback: loading it fails
    later with its own message."""
    config = _read(model_dir)
    if config is None:
        return FALLBACK_DRAFTS
    config.update(overrides or {})
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    architectures = config.get("architectures") or []
    if any(a in QWEN_MTP_ARCHITECTURES for a in architectures):
        return QWEN_MTP_DRAFTS
    if any(a in DENSE_MTP_ARCHITECTURES for a in architectures):
        return DENSE_MTP_DRAFTS
    layers = config.get("num_nextn_predict_layers", text.get("num_nextn_predict_layers"))
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1 else FALLBACK_DRAFTS


def _read(model_dir: str | None) -> dict | None:
    if not model_dir:
        return None
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
