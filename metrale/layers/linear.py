"""Linear layers that own their tensor-parallel sharding.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
slice of a checkpoint tensor into it. Column-parallel layers split the output dimension, row-
parallel ones the input dimension and all-reduce their output; models never branch on TP size.

Uneven head splits (distributed/head_split.py): a column-parallel layer may take an explicit
`output_partition` (rows per rank, in whole heads x head width) and a row-parallel one the matching
`input_partition`; the loaders slice the checkpoint from the sum of the earlier ranks' shares.
Without one, a size must divide over the ranks, as before.

A layer may hold its weight in FP8 (`layers/quantization/fp8_layers.py` sets `fp8` and adds the weight
scales): the loaders are the same, since they only move rows and columns, and scales are loaded
one row per weight row through them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.distributed.head_split import attention_split, scaled, starts_of
from metrale.distributed.parallel_state import get_tp_group
from metrale.kernels.gemv import gemv
from metrale.kernels.skinny_gemm import skinny_gemm
from metrale.layers.deferred_weights import new_weight


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def rank_partition(size: int, tp_size: int, partition: tuple[int, ...] | None, what: str) -> tuple[int, ...]:
    """Each rank's share of `size`: the given partition (checked), else an even split."""
    if partition is None:
        return (divide(size, tp_size, what),) * tp_size
    partition = tuple(partition)
    if len(partition) != tp_size or sum(partition) != size:
        raise ValueError(f"{what} {size}: partition {partition} is not one share per rank of {tp_size}")
    return partition


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
        return dense_linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def process_weights_after_loading(self) -> None:
        if self.fp8 is not None:
            self.fp8.finish_loading(self)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the kernel that reads a dense weight fastest at x's row count
    (the linear layers and the LM head). A decode-sized x is bound by reading the weight once from
    HBM: on CUDA one row takes the Triton GEMV (it beats cuBLAS on every projection of Qwen3-8B
    and on its LM head, benchmarks/gemv_bench.py), 2..16 rows the skinny tensor-core GEMM on the
    shapes where it beat cuBLAS (see SKINNY_GEMM); everything else F.linear."""
    if _one_row(x):
        return gemv(x, weight, bias)
    if _skinny_shape(x, weight):
        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _one_row(x: torch.Tensor) -> bool:
    """The GEMV's rows. Built for up to 8 rows and swept in one H200 job, it tied the skinny GEMM at
    2 rows and lost from 3 on (every extra row costs FMAs: at 5 rows 21.3 us on qkv against the
    skinny's 15.3, 88.6 on gate_up against cuBLAS's 48.3; docs/benchmarks.md)."""
    return x.numel() == x.shape[-1]


# Whether dense_linear takes the skinny GEMM (kernels/skinny_gemm.py, launched without PDL) for
# 2..16 rows. On: in one H200 job at `5a226ea` (benchmarks/spec_verify_bench.py, Qwen3-8B, batch 1)
# verify steps with k = 1 / 2 / 4 drafts took 1.112 / 1.117 / 1.164x a plain step with it and
# 1.133 / 1.140 / 1.189x on cuBLAS. Taking gate_up too (N = 24576) lost (1.124 / 1.132 / 1.179x),
# hence N <= 8192. Benchmarks switch it (--skinny-gemm / --no-skinny-gemm) before graphs are captured.
SKINNY_GEMM = True


def _skinny_shape(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """With SKINNY_GEMM: 2..16 rows on a weight of the shapes the skinny GEMM beat cuBLAS on
    (K >= 4096, N <= 8192: Qwen3-8B's qkv, o_proj and down on an H200)."""
    return SKINNY_GEMM and 2 <= _rows(x) <= 16 and weight.shape[1] >= 4096 and weight.shape[0] <= 8192


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quantizable: bool = True):
        """`quantizable=False`: a router or gate, kept in the model dtype under quantization (as
        vLLM and the published FP8 checkpoints keep them)."""
        super().__init__(input_size, output_size, bias)
        self.quantizable = quantizable


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (the output features) split over the TP ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 output_partition: tuple[int, ...] | None = None):
        """`output_partition`: the output rows of each rank (an uneven head split); default even."""
        tp = get_tp_group()
        self.output_partition = rank_partition(output_size, tp.size, output_partition, "output size")
        self.output_offset = starts_of(self.output_partition)[tp.rank]
        super().__init__(input_size, self.output_partition[tp.rank], bias)

    def weight_loader(self, param, loaded, shard_id=None):
        rows = param.shape[0]
        _copy_checked(param, loaded.narrow(0, self.output_offset, rows), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked in one matmul (gate and up). Each
    is split over the TP ranks on its own: a rank's output is its part of every projection."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 output_partitions: list[tuple[int, ...]] | None = None):
        """`output_partitions`: each projection's rows per rank (uneven head splits); default even."""
        tp = get_tp_group()
        self.output_sizes = output_sizes
        self.output_partitions = [rank_partition(size, tp.size, None if output_partitions is None
                                                 else output_partitions[i], "output size")
                                  for i, size in enumerate(output_sizes)]
        rank_rows = tuple(sum(p[r] for p in self.output_partitions) for r in range(tp.size))
        super().__init__(input_size, sum(output_sizes), bias, output_partition=rank_rows)

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
        rank = self.tp.rank
        load_column_segments(param, loaded, [self.output_sizes[shard_id]], self.tp,
                             param_offset=sum(p[rank] for p in self.output_partitions[:shard_id]),
                             name=f"{type(self).__name__}[{shard_id}]",
                             partitions=[self.output_partitions[shard_id]])


def load_column_segments(param: torch.Tensor, loaded: torch.Tensor, segments: list[int], tp, param_offset: int = 0,
                         name: str = "parameter", partitions: list[tuple[int, ...]] | None = None) -> None:
    """`loaded` stacks `segments` (full sizes, along dim 0); each is split over the TP ranks (by
    its entry of `partitions`, else evenly), and this rank's slices go into `param` back to back
    from row `param_offset`."""
    if loaded.shape[0] != sum(segments):
        raise ValueError(f"{name}: checkpoint rows {loaded.shape[0]} do not match {sum(segments)}")
    full_offset, offset = 0, param_offset
    for i, size in enumerate(segments):
        partition = (size // tp.size,) * tp.size if partitions is None else partitions[i]
        local, start = partition[tp.rank], starts_of(partition)[tp.rank]
        _copy_checked(param.data.narrow(0, offset, local), loaded.narrow(0, full_offset + start, local), name)
        full_offset, offset = full_offset + size, offset + local


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V in one matmul. Heads split over the TP ranks by `attention_split`: evenly, or
    unevenly in whole KV groups; when there are fewer KV heads than ranks, each KV head is
    replicated on tp_size // num_kv_heads ranks. `q_per_head` > 1: each query head's rows carry
    that many head_dim blocks (gated attention: the query, then its output gate)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 q_per_head: int = 1):
        tp = get_tp_group()
        self.head_dim, self.q_per_head = head_dim, q_per_head
        self.split = attention_split(num_heads, num_kv_heads, tp.size)
        self.num_heads, self.num_kv_heads = self.split.q_heads[tp.rank], self.split.kv_heads[tp.rank]
        self.total_num_kv_heads = num_kv_heads
        output = (self.num_heads * q_per_head + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, output, bias)

    def query_partition(self, width: int) -> tuple[int, ...]:
        """Each rank's query features at `width` per head: the o_proj input partition to match."""
        return scaled(self.split.q_heads, width)

    def uneven_head_split(self) -> str | None:
        """What the startup log says of this layer's split; None when it is even."""
        return self.split.describe() if self.split.uneven else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim * self.q_per_head

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param, loaded, shard_id: str = "q"):
        rank = self.tp.rank
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.split.q_start[rank] * self.head_dim * self.q_per_head
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, start = self.kv_size, self.split.kv_start[rank] * self.head_dim
        part = loaded.narrow(0, start, size)
        _copy_checked(param.data.narrow(0, offset, size), part, f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (the input features) split; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_partition: tuple[int, ...] | None = None):
        """`input_partition`: the input features of each rank (an uneven head split, matching the
        column-parallel layer before it); default even."""
        tp = get_tp_group()
        self.input_partition = rank_partition(input_size, tp.size, input_partition, "input size")
        self.input_offset = starts_of(self.input_partition)[tp.rank]
        super().__init__(self.input_partition[tp.rank], output_size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is added once, after the reduction
            _copy_checked(param, loaded, type(self).__name__)
            return
        # An FP8 scale's columns cover `column_unit` features each; quantization/apply.py refuses a
        # partition whose shares are not whole blocks, so the offset divides.
        cols, unit = param.shape[1], getattr(param, "column_unit", 1)
        _copy_checked(param, loaded.narrow(1, self.input_offset // unit, cols), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
