"""SpeculativeConfig: which drafter proposes tokens, and how many, named as vLLM names them.

Given as `speculative_config={...}` to `LLM(...)` or `--speculative-config JSON` on the command
line. The methods in BUILT_METHODS are built; every other method vLLM or the reference
system knows is refused by name, so a configuration never silently runs without the drafter it
asked for.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from metrale.config.dflash_config import DFlashConfig
from metrale.config.json_object import json_object

# Methods a user may reasonably ask for that met does not draft with yet (docs/speculative.md).
NOT_BUILT_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "suffix")
# Drafting with the target's own multi-token-prediction layers (executor/drafters/mtp.py).
MTP_METHODS = ("mtp", "deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp")
# k for MTP when neither num_speculative_tokens nor --num-drafts gives it and no checkpoint says
# more: per model family, EngineArgs passes config/mtp_drafts.py's default_mtp_drafts.
MTP_DEFAULT_DRAFTS = 1
BUILT_METHODS = ("ngram", "dflash") + MTP_METHODS
# Methods that draft with a checkpoint of their own, given as speculative_config's "model".
DRAFTER_MODEL_METHODS = ("dflash",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "cost_model",
         "cost_calibration", "model")
# static: k = num_speculative_tokens every step; measured: k per step from a calibration table
# (engine/spec_cost_model.py, docs/speculative.md "The cost model").
COST_MODELS = ("static", "measured")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: the most draft tokens verified per request and step
    # The n-gram drafter matches the sequence's last n tokens, n from max down to min, against
    # its earlier tokens (prompt and output) and proposes the k tokens that followed the match.
    prompt_lookup_min: int
    prompt_lookup_max: int
    cost_model: str = "static"
    cost_calibration: str | None = None  # the table `measured` reads (met benchmark spec-cost-table)
    model: str | None = None  # the drafter checkpoint directory (dflash)

    @classmethod
    def parse(cls, value: str | dict | None, num_drafts: int | None = None, cost_model: str | None = None,
              cost_calibration: str | None = None,
              mtp_default_drafts: int = MTP_DEFAULT_DRAFTS) -> "SpeculativeConfig | None":
        """From a dict or a JSON object (None or "" : no speculation). `num_drafts` (the
        reference system's --num-drafts) gives k when the config leaves it out, and
        `mtp_default_drafts` (the model family's) when both leave it out for MTP; `cost_model`
        and `cost_calibration` (--spec-cost-model, --spec-cost-calibration) likewise give the
        keys of the same names. ValueError names what is wrong."""
        if value is None or (isinstance(value, str) and not value.strip()):
            for name, given in (("num_drafts", num_drafts), ("spec_cost_model", cost_model),
                                ("spec_cost_calibration", cost_calibration)):
                if given is not None:
                    raise ValueError(f"{name} configures a drafter, and no drafter is configured: give "
                                     "speculative_config too")
            return None
        value = json_object(value, "speculative_config")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; met takes "
                             f"{', '.join(_KEYS)}")
        method = value.get("method")
        if method in NOT_BUILT_METHODS:
            raise ValueError(f"speculative_config method {method!r} is not built yet; the built methods are "
                             f"{', '.join(BUILT_METHODS)} (docs/speculative.md)")
        if method not in BUILT_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(BUILT_METHODS)}, "
                             f"got {method!r}")
        k = value.get("num_speculative_tokens", num_drafts)
        if k is None and method in MTP_METHODS:
            k = mtp_default_drafts
        if num_drafts is not None and k != num_drafts:
            raise ValueError(f"num_drafts {num_drafts} and speculative_config's num_speculative_tokens {k} "
                             "disagree; give one")
        lookup_max = value.get("prompt_lookup_max", value.get("prompt_lookup_min"))
        lookup_min = value.get("prompt_lookup_min", lookup_max)
        if lookup_min is None:
            lookup_min = lookup_max = 3  # neither given: vLLM's default window
        for name, number in (("num_speculative_tokens", k), ("prompt_lookup_min", lookup_min),
                             ("prompt_lookup_max", lookup_max)):
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {number!r}")
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min {lookup_min} is above prompt_lookup_max "
                             f"{lookup_max}")
        model = _one_of(value, "cost_model", cost_model, "spec_cost_model") or "static"
        calibration = _one_of(value, "cost_calibration", cost_calibration, "spec_cost_calibration")
        if model not in COST_MODELS:
            raise ValueError(f"speculative_config cost_model must be one of {', '.join(COST_MODELS)}, got {model!r}")
        if model == "measured" and not calibration:
            raise ValueError("speculative_config cost_model 'measured' needs a calibration table: "
                             "--spec-cost-calibration FILE (or the key cost_calibration), written by "
                             "`met benchmark spec-cost-table`")
        if model == "static" and calibration:
            raise ValueError("a spec-cost calibration table is read only with cost_model 'measured' "
                             "(--spec-cost-model measured); static drafts num_speculative_tokens every step")
        return cls(method, k, lookup_min, lookup_max, model, calibration or None, _drafter_model(value, method, k))


def _drafter_model(value: dict, method: str, k: int) -> str | None:
    """The drafter checkpoint directory of a method that has one (its config read and k checked
    against its block size now, before any weight loads); refused for the others."""
    drafter_dir = value.get("model")
    if method not in DRAFTER_MODEL_METHODS:
        if drafter_dir is not None:
            raise ValueError(f"speculative_config model is read only by {', '.join(DRAFTER_MODEL_METHODS)}; "
                             f"method {method!r} drafts without a checkpoint of its own")
        return None
    if not isinstance(drafter_dir, str) or not drafter_dir:
        raise ValueError(f"speculative_config method {method!r} needs model: the drafter checkpoint directory")
    drafter = DFlashConfig.read(drafter_dir)
    if k > drafter.max_drafts:
        raise ValueError(f"speculative_config num_speculative_tokens {k} is above what the DFlash drafter "
                         f"{drafter_dir!r} drafts in one pass: {drafter.max_drafts} (its block_size "
                         f"{drafter.block_size} - 1)")
    return drafter_dir


def _one_of(value: dict, key: str, given, flag: str):
    """speculative_config's `key`, or the option `flag` that gives it; both: they must agree."""
    if key in value and given is not None and value[key] != given:
        raise ValueError(f"{flag} {given!r} and speculative_config's {key} {value[key]!r} disagree; give one")
    return value.get(key, given)


def ngram_sha256(prompt_lookup_min: int, prompt_lookup_max: int) -> str:
    """The n-gram drafter's identity (it has no weights): the sha256 of its settings' canonical
    JSON, as the spec-cost table keys drafters (engine/spec_cost_identity.py)."""
    settings = {"method": "ngram", "prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
