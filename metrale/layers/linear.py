"""Linear layers that own their tensor-parallel sharding.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
slice of a checkpoint tensor into it. Column-parallel layers split the output dimension, row-
parallel ones the input dimension and all-reduce their output; models never branch on TP size.

A layer may hold its weight in FP8 (`layers/quantization/fp8_layers.py` sets `fp8` and adds the weight
scales): the loaders are the same, since they only move rows and columns, and scales are loaded
one row per weight row through them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.distributed.parallel_state import get_tp_group
from metrale.kernels.gemv import gemv
from metrale.layers.deferred_weights import new_weight


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    # Whether quantization may store this layer's weight in FP8 (routers stay in the model dtype).
    quantizable = True

    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp = get_tp_group()
        self.input_size, self.output_size = input_size, output_size
        self.weight = new_weight(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        self.fp8 = None  # an Fp8Linear (layers/quantization/fp8_layers.py) when the weight is FP8
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, loaded, type(self).__name__)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.matmul(self, x, bias)
        # One token (batch-1 decode) reads the weight once: on CUDA the Triton GEMV beats cuBLAS
        # on every projection of Qwen3-8B at one row (benchmarks/gemv_bench.py). Else F.linear.
        return gemv(x, self.weight, bias) if _one_row(x) else F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def process_weights_after_loading(self) -> None:
        if self.fp8 is not None:
            self.fp8.finish_loading(self)


def _one_row(x: torch.Tensor) -> bool:
    return x.numel() == x.shape[-1]


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quantizable: bool = True):
        """`quantizable=False`: a router or gate, kept in the model dtype under quantization (as
        vLLM and the published FP8 checkpoints keep them)."""
        super().__init__(input_size, output_size, bias)
        self.quantizable = quantizable


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (the output features) split over the TP ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_group()
        super().__init__(input_size, divide(output_size, tp.size, "output size"), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        rows = param.shape[0]
        _copy_checked(param, loaded.narrow(0, self.tp.rank * rows, rows), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked in one matmul (gate and up). Each
    is split over the TP ranks on its own: a rank's output is its part of every projection."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp = get_tp_group()
        for size in output_sizes:
            divide(size, tp.size, "output size")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int | tuple[int, ...] = 0):
        """`shard_id`: which projection `loaded` is; a tuple: several, concatenated in order."""
        if isinstance(shard_id, tuple):
            sizes = [self.output_sizes[shard] for shard in shard_id]
            if sum(sizes) != loaded.shape[0]:
                raise ValueError(f"{type(self).__name__}{list(shard_id)}: checkpoint rows {loaded.shape[0]} do not "
                                 f"match {sum(sizes)}")
            for shard, part in zip(shard_id, loaded.split(sizes)):
                self.weight_loader(param, part, shard)
            return
        load_column_segments(param, loaded, [self.output_sizes[shard_id]],
                             self.tp, param_offset=sum(self.output_sizes[:shard_id]) // self.tp.size,
                             name=f"{type(self).__name__}[{shard_id}]")


def load_column_segments(param: torch.Tensor, loaded: torch.Tensor, segments: list[int], tp, param_offset: int = 0,
                         name: str = "parameter") -> None:
    """`loaded` stacks `segments` (full sizes, along dim 0); each is split over the TP ranks, and
    this rank's slices go into `param` back to back from row `param_offset`."""
    if loaded.shape[0] != sum(segments):
        raise ValueError(f"{name}: checkpoint rows {loaded.shape[0]} do not match {sum(segments)}")
    full_offset, offset = 0, param_offset
    for size in segments:
        local = size // tp.size
        _copy_checked(param.data.narrow(0, offset, local), loaded.narrow(0, full_offset + tp.rank * local, local), name)
        full_offset, offset = full_offset + size, offset + local


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V in one matmul. Heads split over the TP ranks; when there are fewer KV heads than
    ranks, each KV head is replicated on tp_size // num_kv_heads ranks. `q_per_head` > 1: each
    query head's rows carry that many head_dim blocks (gated attention: the query, then its
    output gate)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 q_per_head: int = 1):
        tp = get_tp_group()
        self.head_dim, self.q_per_head = head_dim, q_per_head
        self.num_heads = divide(num_heads, tp.size, "number of attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "number of KV heads")
        else:
            divide(tp.size, num_kv_heads, "TP size over KV heads")
            self.num_kv_heads = 1
        self.total_num_kv_heads = num_kv_heads
        output = (self.num_heads * q_per_head + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, output, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim * self.q_per_head

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param, loaded, shard_id: str = "q"):
        tp = self.tp
        if shard_id == "q":
            offset, size, index = 0, self.q_size, tp.rank
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size = self.kv_size
            replicas = max(1, tp.size // self.total_num_kv_heads)
            index = tp.rank // replicas
        part = loaded.narrow(0, index * size, size)
        _copy_checked(param.data.narrow(0, offset, size), part, f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (the input features) split; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_group()
        super().__init__(divide(input_size, tp.size, "input size"), output_size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is added once, after the reduction
            _copy_checked(param, loaded, type(self).__name__)
            return
        cols = param.shape[1]
        _copy_checked(param, loaded.narrow(1, self.tp.rank * cols, cols), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
