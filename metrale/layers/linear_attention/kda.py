"""Kimi Delta Attention (KDA): the linear-attention layer of GLM-5.3 (Glm5NextTextLinearAttention
in transformers) and Kimi Linear, the whole token mixer.

    [q | k | v] = qkv_proj(x)                                one matmul (checkpoint: q/k/v_proj)
    q, k, v     = split(silu(causal_conv1d([q | k | v])))    per request, over its saved inputs
    g           = forget_gate(x)                             per-channel log decay [heads, head_dim]
    o           = kimi_delta_rule(l2norm(q), l2norm(k), v, g, beta = sigmoid(b_proj(x)))
    out         = o_proj(rmsnorm(o) * sigmoid(g_b_proj(g_a_proj(x))))     per head

The forget gate: f = f_b_proj(f_a_proj(x)) + dt_bias, then lower_bound * sigmoid(exp(A_log) *
f) with GLM-5.3's lower bound ("safe gate", -5 by default), else -exp(A_log) * softplus(f)
(kernels/reference_kda.py). Every head has head_dim keys and values.

It is a CachedLayer of kind "kda" with one state spec: the conv state (the last kernel - 1 inputs
of the conv over [q | k | v], stored [kernel - 1, conv_dim] and seen as [conv_dim, kernel - 1];
model dtype) and the recurrent state ([heads, head_dim, head_dim], --ssm-h-dtype) of each request.

Submodules carry the checkpoint's names (conv1d, forget_gate.{f_a_proj, f_b_proj, dt_bias,
A_log}, b_proj, g_a_proj, g_b_proj, o_norm, o_proj) except q/k/v_proj, stacked into qkv_proj
(STACKED_PARAMS, in a model's stacked_params format).

Tensor parallel: heads split over the ranks, as evenly as possible where they do not divide
(distributed/head_split.py): q/k/v, f_b_proj, g_b_proj and b_proj column-parallel, each conv
segment, dt_bias and A_log split by head, o_proj row-parallel with the matching input partition;
f_a_proj and g_a_proj, which project to one head_dim, are replicated. A rank's state holds its
heads only. Tested by emulating the ranks in one process (tests/layers/test_kda.py), not over
real ranks yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metrale.config.cache_config import CacheConfig
from metrale.distributed.head_split import is_uneven, per_rank, scaled, split_heads
from metrale.distributed.parallel_state import get_tp_group
from metrale.kernels.reference_kda import kda_forget_gate
from metrale.layers.cache_spec import StateCacheSpec, StateTensorSpec
from metrale.layers.forward_context import get_forward_context
from metrale.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear,
                                   RowParallelLinear, load_column_segments)
from metrale.layers.linear_attention.kda_backend import KIND

# (ours, the checkpoint's, shard): q/k/v_proj load into qkv_proj's segments.
STACKED_PARAMS = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2)]
# The conv weight as GLM-5.3's checkpoints store it, one per projection (transformers concatenates them).
CONV_STACKED_PARAMS = [("conv1d", "q_conv1d", 0), ("conv1d", "k_conv1d", 1), ("conv1d", "v_conv1d", 2)]


@dataclass(frozen=True)
class KDADims:
    hidden_size: int
    num_heads: int  # all ranks together
    head_dim: int
    conv_kernel: int
    lower_bound: float | None  # None: the softplus decay
    eps: float

    @classmethod
    def of(cls, hf) -> "KDADims":
        """From a Glm5NextTextConfig; a short-conv activation other than silu is refused."""
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"KDA's short convolution runs silu; hidden_act={hf.hidden_act!r} is not supported")
        return cls(hf.hidden_size, hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim,
                   hf.linear_lower_bound, hf.rms_norm_eps)


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm of each head in float32, scaled by the weight, then gated by sigmoid(gate): KDA's
    o_norm (transformers' RMSNormGated with activation sigmoid)."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., head_dim] -> the same shape, in x's dtype."""
        h = x.float()
        h = self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return (h * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, dims: KDADims, layer_index: int):
        super().__init__()
        tp = get_tp_group()
        self.dims, self.layer_index, self.tp = dims, layer_index, tp
        self.heads_per_rank = split_heads(dims.num_heads, tp.size, "KDA heads")
        self.num_heads = self.heads_per_rank[tp.rank]
        full, d = dims.num_heads * dims.head_dim, dims.head_dim
        self.width = self.num_heads * d  # one of q, k, v on this rank
        self.conv_dim = 3 * self.width
        self._channels = scaled(self.heads_per_rank, d)  # per rank: one of q, k, v; dt_bias; o_proj's input
        self.qkv_proj = MergedColumnParallelLinear(dims.hidden_size, [full] * 3, output_partitions=[self._channels] * 3)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, dims.conv_kernel), requires_grad=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.forget_gate = nn.Module()
        self.forget_gate.f_a_proj = ReplicatedLinear(dims.hidden_size, dims.head_dim)
        self.forget_gate.f_b_proj = ColumnParallelLinear(d, full, output_partition=self._channels)
        self.forget_gate.dt_bias = nn.Parameter(torch.zeros(self.width), requires_grad=False)
        self.forget_gate.A_log = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.forget_gate.dt_bias.weight_loader = self._load_by_head
        self.forget_gate.A_log.weight_loader = self._load_by_head
        self.b_proj = ColumnParallelLinear(dims.hidden_size, dims.num_heads, output_partition=self.heads_per_rank)
        self.g_a_proj = ReplicatedLinear(dims.hidden_size, d)
        self.g_b_proj = ColumnParallelLinear(d, full, output_partition=self._channels)
        self.o_norm = SigmoidGatedRMSNorm(d, dims.eps)
        self.o_proj = RowParallelLinear(full, dims.hidden_size, input_partition=self._channels)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, kernel - 1] (a view), bound by the runner
        self.recurrent_state: torch.Tensor | None = None  # [slots, heads, head_dim, head_dim]

    # -- weights -----------------------------------------------------------------------------

    def _load_conv(self, param, loaded, shard_id=None):
        """The whole [q | k | v] conv weight, or with `shard_id` 0, 1, 2 one of q_conv1d,
        k_conv1d, v_conv1d (GLM-5.3's checkpoints store them apart: CONV_STACKED_PARAMS)."""
        if tuple(loaded.shape[1:]) != (1, self.dims.conv_kernel):
            raise ValueError(f"KDA conv1d weight shape {tuple(loaded.shape)} does not match "
                             f"({3 * self.dims.num_heads * self.dims.head_dim}, 1, {self.dims.conv_kernel})")
        full = self.dims.num_heads * self.dims.head_dim
        if shard_id is None:
            load_column_segments(param, loaded, [full] * 3, self.tp, name="KDA conv1d",
                                 partitions=[self._channels] * 3)
            return
        load_column_segments(param, loaded, [full], self.tp, param_offset=shard_id * self.width,
                             name=f"KDA conv1d[{shard_id}]", partitions=[self._channels])

    def _load_by_head(self, param, loaded, shard_id=None):
        """dt_bias (head_dim per head) and A_log (one per head): this rank's heads."""
        partition = self._channels if loaded.shape[0] == sum(self._channels) else self.heads_per_rank
        load_column_segments(param, loaded, [loaded.shape[0]], self.tp, name="KDA per-head parameter",
                             partitions=[partition])

    def uneven_head_split(self) -> str | None:
        """What the startup log says of this layer's split; None when it is even."""
        return f"KDA heads {per_rank(self.heads_per_rank)} per rank" if is_uneven(self.heads_per_rank) else None

    # -- the cache ---------------------------------------------------------------------------

    def cache_specs(self, config: CacheConfig) -> tuple[StateCacheSpec]:
        d = self.dims.head_dim
        return (StateCacheSpec(KIND, (
            StateTensorSpec("conv", (self.dims.conv_kernel - 1, self.conv_dim), config.model_dtype),
            StateTensorSpec("recurrent", (self.num_heads, d, d), config.ssm_state_dtype))),)

    def bind_caches(self, caches: tuple[torch.Tensor, ...] | None) -> None:
        if caches is None:
            self.conv_state = self.recurrent_state = None
            return
        conv, self.recurrent_state = caches
        self.conv_state = conv.transpose(1, 2)

    # -- the forward pass --------------------------------------------------------------------

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size] (summed over the TP ranks); positions are
        not used (the state is)."""
        if self.recurrent_state is None:
            raise RuntimeError(f"the state cache is not bound to the KDA layer {self.layer_index}")
        ctx = get_forward_context()
        backend, metadata = ctx.backends[KIND], ctx.metadata[KIND]
        tokens, heads, d = hidden.shape[0], self.num_heads, self.dims.head_dim
        mixed = backend.conv(self.qkv_proj(hidden), self.conv1d.weight.view(self.conv_dim, self.dims.conv_kernel),
                             self.conv_state, metadata)
        q, k, v = (t.reshape(tokens, heads, d) for t in mixed.split(self.width, dim=-1))
        gate = self.forget_gate
        g = kda_forget_gate(gate.f_b_proj(gate.f_a_proj(hidden)).view(tokens, heads, d), gate.A_log, gate.dt_bias,
                            self.dims.lower_bound)
        beta = torch.sigmoid(self.b_proj(hidden))
        out = backend.delta_rule(q, k, v, g, beta, self.recurrent_state, metadata)
        out_gate = self.g_b_proj(self.g_a_proj(hidden)).view(tokens, heads, d)
        return self.o_proj(self.o_norm(out, out_gate).reshape(tokens, self.width))
