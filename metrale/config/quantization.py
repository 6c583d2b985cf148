"""Which quantized format a model runs in: read from config.json's `quantization_config` or
asked for with `--quantization`, checked before anything is loaded.

Supported:
  fp8 (checkpoint)  fine-grained block FP8, transformers' FineGrainedFP8 / DeepSeek-V3 format:
                    float8_e4m3fn weights with a float32 (or bfloat16) `weight_scale_inv` per
                    `weight_block_size` block (128 x 128 in every published checkpoint), dynamic
                    activation quantization per token and group of block_k features.
  fp8 (online)      `--quantization fp8` on an unquantized checkpoint: each weight is quantized
                    as it loads, one scale per output row and group of 128 input features (per
                    output channel, in groups, so that a TP rank's shard of a row-parallel layer
                    is quantized exactly as on one GPU); activations as above.

Everything else is refused by name: another method (awq, gptq, bitsandbytes, compressed-
tensors, ...), per-tensor FP8 (no weight_block_size), static activation scales, e5m2.
"""

from __future__ import annotations

from dataclasses import dataclass

from metrale.config.errors import ModelLoadError

# quant_method values met loads, and what --quantization takes.
SUPPORTED_METHODS = ("fp8",)
ONLINE_GROUP = 128  # online quantization: scale groups of this many input features per row
ACTIVATION_QUANTIZATION = ("dynamic", "none")


class QuantizationError(ModelLoadError):
    """A quantized checkpoint or option met does not load; the message names it."""


@dataclass(frozen=True)
class Fp8Config:
    """How FP8 weights are laid out in the checkpoint (or quantized at load) and run.

    block_n, block_k: the scale block of the checkpoint's weights ([1, 128] when quantized
    online). activation_group: features per activation scale, or None to keep activations in the
    model dtype (W8A16; `--activation-quantization none`). ignored: module names left unquantized
    (modules_to_not_convert / ignored_layers). online: the checkpoint is unquantized, and each
    weight is quantized as it is loaded."""

    block_n: int
    block_k: int
    activation_group: int | None
    ignored: tuple[str, ...] = ()
    online: bool = False

    def skips(self, module_name: str) -> bool:
        """Whether a module (our name or the checkpoint's: both spell the same path down to the
        projection) stays unquantized: it or one of its parents is listed, or it ends with a
        listed suffix (`lm_head`, `mlp.gate`)."""
        dotted = f".{module_name}."
        return any(dotted.find(f".{name}.") >= 0 or module_name == name for name in self.ignored)

    def describe(self) -> str:
        activations = "activations in the model dtype" if self.activation_group is None else \
            f"activations per token in groups of {self.activation_group}"
        source = f"quantized at load, [1, {self.block_k}] scales" if self.online else \
            f"[{self.block_n}, {self.block_k}] blocks"
        skipped = f", {len(self.ignored)} module(s) unquantized" if self.ignored else ""
        return f"fp8 e4m3 weights ({source}), {activations}{skipped}"


def _refuse(model_dir: str, what: str) -> QuantizationError:
    return QuantizationError(f"{model_dir!r}: {what}. met loads these quantized formats: fine-grained block FP8 "
                             f"(quant_method 'fp8' with weight_block_size), and --quantization fp8 on an "
                             f"unquantized checkpoint (docs/quantization.md).")


def _checkpoint_fp8(config: dict, model_dir: str, activation_group_on: bool) -> Fp8Config:
    block = config.get("weight_block_size")
    if not block:
        raise _refuse(model_dir, "quantization_config 'fp8' without weight_block_size is per-tensor FP8, which met "
                                 "does not load yet")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(model_dir, f"weight_block_size {block!r} is not two positive integers")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(model_dir, f"activation_scheme {scheme!r} (static activation scales) is not supported; only "
                                 f"'dynamic'")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(model_dir, f"FP8 format {fmt!r} is not supported; only 'e4m3'")
    ignored = tuple(config.get("modules_to_not_convert") or ()) + tuple(config.get("ignored_layers") or ())
    block_n, block_k = block
    return Fp8Config(block_n, block_k, block_k if activation_group_on else None, ignored)


def resolve_quantization(quantization_config: dict | None, requested: str | None, activation_quantization: str,
                         model_dir: str) -> Fp8Config | None:
    """The format to run, from the checkpoint's `quantization_config` and `--quantization`;
    None for an unquantized model. Refuses what met cannot load, naming it."""
    if activation_quantization not in ACTIVATION_QUANTIZATION:
        raise QuantizationError(f"--activation-quantization {activation_quantization!r}: expected one of "
                                f"{', '.join(ACTIVATION_QUANTIZATION)}")
    if requested not in (None, "", "none") and requested not in SUPPORTED_METHODS:
        raise QuantizationError(f"--quantization {requested!r} is not supported; supported: "
                                f"{', '.join(SUPPORTED_METHODS)}")
    dynamic = activation_quantization == "dynamic"
    if quantization_config:
        if not isinstance(quantization_config, dict):
            raise _refuse(model_dir, f"quantization_config {quantization_config!r} is not an object")
        method = quantization_config.get("quant_method", "(no quant_method)")
        if method not in SUPPORTED_METHODS:
            raise _refuse(model_dir, f"the checkpoint is quantized with {method!r} (config.json "
                                     f"quantization_config), which met does not load")
        return _checkpoint_fp8(quantization_config, model_dir, dynamic)
    if requested in (None, "", "none"):
        return None
    return Fp8Config(1, ONLINE_GROUP, ONLINE_GROUP if dynamic else None, online=True)
