"""Runner-side drafters of speculative decoding (base.py states the contract): built at startup
from the SpeculativeConfig and the loaded target model."""

from __future__ import annotations

import torch

from metrale.config.errors import OptionError
from metrale.config.speculative_config import MTP_METHODS, SpeculativeConfig
from metrale.executor.drafters.base import RunnerDrafter


def runs_in_runner(spec: SpeculativeConfig | None, asynchronous: bool = False) -> bool:
    """MTP and DFlash draft in the runner always; n-gram there under asynchronous scheduling
    (drafters/ngram.py), on the scheduler's side otherwise."""
    return spec is not None and (spec.method in MTP_METHODS or spec.method == "dflash"
                                 or (spec.method == "ngram" and asynchronous))


def build_drafter(spec: SpeculativeConfig | None, model: torch.nn.Module, max_model_len: int,
                  block_size: int, asynchronous: bool = False) -> RunnerDrafter | None:
    """The runner-side drafter `spec` asks for, over the loaded `model`; None for none or the
    scheduler's n-gram drafter. `asynchronous`: the engine will schedule asynchronously."""
    if not runs_in_runner(spec, asynchronous):
        return None
    if spec.method == "ngram":
        from metrale.executor.drafters.ngram import NgramRunnerDrafter

        return NgramRunnerDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                  max_model_len)
    if spec.method == "dflash":
        from metrale.executor.drafters.dflash import DFlashDrafter

        return DFlashDrafter(model, spec.model, spec.num_speculative_tokens)
    from metrale.executor.drafters.mtp import MTPDrafter

    return MTPDrafter(model, spec.num_speculative_tokens, max_model_len, block_size)


def drafter_cached_layers(spec: SpeculativeConfig | None, model: torch.nn.Module) -> list:
    """The stateful modules the drafter `spec` asks for will own, from a (meta-device) build of
    the model: the memory plan counts their caches before the weights load."""
    if not runs_in_runner(spec):
        return []
    if spec.method == "dflash":
        from metrale.executor.drafters.dflash import dflash_cached_layers

        return dflash_cached_layers(model, spec.model, spec.num_speculative_tokens)
    if not getattr(model, "mtp", None):
        architecture = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
        unavailable = getattr(model, "mtp_unavailable", None)  # a family's reason for not loading them
        if unavailable:
            raise OptionError(f"speculative_config method {spec.method!r} (--speculative) drafts with the model's "
                              f"multi-token-prediction layers, and met does not load this {architecture} "
                              f"checkpoint's: {unavailable}; method 'ngram' drafts by prompt lookup")
        raise OptionError(f"speculative_config method {spec.method!r} (--speculative) drafts with the model's "
                          f"multi-token-prediction layers, and this {architecture} checkpoint holds none "
                          "(num_nextn_predict_layers / mtp_num_hidden_layers 0, or the layers stripped); "
                          "method 'ngram' drafts by prompt lookup")
    return model.mtp[0].cached_layers()


def drafter_buffer_bytes(spec: SpeculativeConfig | None, asynchronous: bool, max_num_seqs: int,
                         max_model_len: int) -> int:
    """The device bytes of a runner-side drafter's own buffers: the n-gram drafter's token history."""
    if not runs_in_runner(spec, asynchronous) or spec.method != "ngram":
        return 0
    from metrale.executor.drafters.ngram import history_bytes

    return history_bytes(max_num_seqs, max_model_len)


def drafter_weight_bytes(spec: SpeculativeConfig | None, model: torch.nn.Module) -> int:
    """The bytes of a drafter's own weights that the (meta-device) model does not hold: a DFlash
    drafter's checkpoint (MTP layers are the model's own parameters, counted with it)."""
    if spec is None or spec.method != "dflash":
        return 0
    from metrale.executor.drafters.dflash import dflash_weight_bytes

    return dflash_weight_bytes(model, spec.model, spec.num_speculative_tokens)
