"""Give a model built under `deferred_weights()` its real weights: FP8 where the quantization
config and the layer allow it, the model dtype elsewhere.

A linear layer is FP8 when it is `quantizable` (routers and gates are not) and at least one of
its checkpoint pieces is not listed unquantized (`modules_to_not_convert`); a merged projection
whose other pieces are listed has those quantized as they load (loader/fp8_pairs.py).
Expert layers are FP8 unless their module is listed.

Tensor parallelism: a shard that cuts a block of the input features (a row-parallel layer's
columns, an expert's intermediate slice) is refused, naming the tp sizes that keep blocks
whole; under an uneven head split every rank's share must be whole blocks. Output rows may
split anywhere: scales load one row per weight row (scales.py), so any row split is exact; a
layer whose split cuts its blocks keeps per-row scales, and a line in the log says which tp
sizes would not.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from metrale.distributed.topology import TopologyError
from metrale.layers.deferred_weights import is_deferred
from metrale.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from metrale.layers.moe.layer import FusedMoE
from metrale.config.quantization import Fp8Config
from metrale.layers.quantization.fp8_layers import Fp8Experts, Fp8Linear, fp8_parameter, scale_parameter

logger = logging.getLogger(__name__)


def checkpoint_module_names(model: nn.Module, module_name: str) -> list[str]:
    """The checkpoint's names of the projections our module holds: renames undone, stacked
    pieces (qkv_proj -> q_proj, k_proj, v_proj) listed."""
    name = f"{module_name}."
    for theirs, ours in reversed(getattr(model, "checkpoint_renames", ())):
        name = name.replace(ours, theirs)
    name = name[:-1]
    parent, _, leaf = name.rpartition(".")
    pieces = [theirs for ours, theirs, _ in getattr(model, "stacked_params", []) if ours == leaf]
    return [f"{parent}.{piece}" if parent else piece for piece in pieces] or [name]


def working_tp_sizes(features: int, block: int, limit: int = 16) -> list[int]:
    return [t for t in range(1, limit + 1) if features % t == 0 and (t == 1 or (features // t) % block == 0)]


def _check_input_split(what: str, full: int, tp: int, block_k: int,
                       partition: tuple[int, ...] | None = None) -> None:
    """`partition`: each rank's input features when they split unevenly (default full / tp each)."""
    partition = partition or (full // tp,) * tp
    if tp > 1 and any(share % block_k for share in partition):
        sizes = ", ".join(map(str, working_tp_sizes(full, block_k)))
        shares = "/".join(map(str, partition)) if len(set(partition)) > 1 else str(partition[0])
        raise TopologyError(f"{what}: its {full} input features split over {tp} ranks into {shares} per rank, "
                            f"which cuts the {block_k}-wide groups its FP8 scales cover; tp sizes that keep "
                            f"them whole: {sizes}")


def _output_segments(layer: LinearBase) -> list[int]:
    """Per-rank row counts of the checkpoint pieces a column-parallel layer stacks."""
    if hasattr(layer, "output_sizes"):
        return [partition[layer.tp.rank] for partition in layer.output_partitions]
    if hasattr(layer, "q_size"):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    return [layer.output_size]


def _note_output_split(name: str, layer: LinearBase, block_n: int) -> None:
    if layer.tp.size > 1 and isinstance(layer, ColumnParallelLinear):
        cut = [rows for rows in _output_segments(layer) if rows % block_n]
        if cut:
            logger.info("%s: tp=%d splits its output rows through %d-row FP8 blocks (%s rows per rank): its scales "
                        "stay one per row", name, layer.tp.size, block_n, "/".join(map(str, cut)))


def _linear_to_fp8(name: str, layer: LinearBase, config: Fp8Config, device) -> None:
    if isinstance(layer, RowParallelLinear):
        _check_input_split(name, sum(layer.input_partition), layer.tp.size, config.block_k, layer.input_partition)
    _note_output_split(name, layer, config.block_n)
    old = layer.weight
    layer.weight = fp8_parameter(*old.shape, device=device, like=old)
    layer.weight_scale_inv = scale_parameter(*old.shape, block_k=config.block_k, device=device,
                                             loader=layer.weight.weight_loader)
    layer.fp8 = Fp8Linear(config.block_n, config.block_k, config.activation_group)


def _experts_to_fp8(name: str, layer: FusedMoE, config: Fp8Config, device) -> None:
    tp = layer.layout.tp_size
    _check_input_split(f"{name} (down_proj)", layer.intermediate_size, tp, config.block_k)
    for param_name in ("w13", "w2"):
        old = getattr(layer, param_name)
        setattr(layer, param_name, fp8_parameter(*old.shape, device=device, like=old))
        setattr(layer, f"{param_name}_weight_scale_inv",
                scale_parameter(*old.shape, block_k=config.block_k, device=device, loader=layer.weight_loader))
    layer.fp8 = Fp8Experts(config.block_n, config.block_k, config.activation_group)


def _materialize(module: nn.Module, param_name: str, device, dtype: torch.dtype) -> None:
    old = getattr(module, param_name)
    param = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=device), requires_grad=False)
    if hasattr(old, "weight_loader"):
        param.weight_loader = old.weight_loader
    setattr(module, param_name, param)


def _in_fp8(model: nn.Module, name: str, module: nn.Module, config: Fp8Config | None) -> bool:
    """Whether a linear or expert layer holds FP8: quantizable, and not every checkpoint piece
    of it listed unquantized."""
    return (config is not None and getattr(module, "quantizable", True)
            and not all(config.skips(piece) for piece in checkpoint_module_names(model, name)))


def quantize_model(model: nn.Module, config: Fp8Config | None, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate every deferred weight on `device`: FP8 per `config`, else in `dtype`."""
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and is_deferred(module.weight):
            params, to_fp8 = ("weight",), _linear_to_fp8
        elif isinstance(module, FusedMoE) and is_deferred(module.w13):
            params, to_fp8 = ("w13", "w2"), _experts_to_fp8
        else:
            continue
        if _in_fp8(model, name, module, config):
            to_fp8(name, module, config, device)
        else:
            for param_name in params:
                _materialize(module, param_name, device, dtype)
