"""What a spec-cost calibration table is valid for, computed the same way where a table is written
(bench/spec_cost_table.py) and where one is loaded (engine.py): the drafter, the target model and
the device. A table is used only when all three match (CostTable.check_identity).

- drafter: the method and the sha256 of its weights: the MTP layers' `model.mtp_sha256`, a
  runner-side drafter's `.sha256` (DFlash: its checkpoint's). The n-gram drafter has no weights:
  its key is the sha256 of the canonical JSON of {"method": "ngram", "prompt_lookup_min": ...,
  "prompt_lookup_max": ...}.
- target: the architecture, the sha256 of its effective config (config.json with --hf-overrides
  applied, canonical JSON, without transformers' bookkeeping fields), the dtype, the weight and
  KV cache quantization, the tensor / expert parallel sizes. A step's time follows from these
  shapes and types, not from the weights' values, so `--load-format dummy` measures the real model.
- device: the GPU's name ("cpu" on the CPU).

Provenance (recorded, not checked): torch and triton versions, the commit, the forward mode.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

from metrale.config.speculative_config import ngram_sha256

# Fields of a transformers config that name where or by what it was written, not the model.
_BOOKKEEPING = ("transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation_autoset")


def canonical_sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()




def drafter_identity(spec, model, runner_drafter=None) -> dict:
    """{"method", "sha256"} of the configured drafter (spec: SpeculativeConfig)."""
    if spec.method == "ngram":
        return {"method": "ngram", "sha256": ngram_sha256(spec.prompt_lookup_min, spec.prompt_lookup_max)}
    sha = getattr(runner_drafter, "sha256", None) or getattr(model, "mtp_sha256", None)
    if not sha:
        raise ValueError(f"drafter {spec.method!r} has no weights' sha256 to key a spec-cost table by")
    return {"method": spec.method, "sha256": sha}


def target_identity(args, model_config) -> dict:
    config = model_config.hf_config
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    fields = {k: v for k, v in fields.items() if k not in _BOOKKEEPING and not k.startswith("_")}
    return {"architecture": model_config.architecture, "config_sha256": canonical_sha256(fields),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "quantization": args.quantization or ("checkpoint" if model_config.quantization is not None else None),
            "kv_cache_dtype": args.kv_cache_dtype, "tp_size": args.tp_size, "ep_size": args.ep_size}


def device_name(device) -> str:
    if device.type != "cuda":
        return device.type
    import torch

    return torch.cuda.get_device_name(device)


def setup_identity(args, model_config, device, model, spec, runner_drafter=None) -> dict:
    return {"drafter": drafter_identity(spec, model, runner_drafter), "target": target_identity(args, model_config),
            "device": device_name(device)}


def provenance(args) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    # MET_COMMIT (the benchmark scripts set it) wins: a copy of the tree may carry another .git.
    commit = os.environ.get("MET_COMMIT")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"torch": torch.__version__, "triton": triton_version, "commit": commit, "forward": args.forward,
            "enforce_eager": args.enforce_eager, "model": args.model, "load_format": args.load_format,
            "hf_overrides": args.config_overrides}
