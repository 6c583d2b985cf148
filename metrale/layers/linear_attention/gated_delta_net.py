"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5.

    [q | k | v | z | b | a] = in_proj(x)                     one matmul (one GEMV at batch 1)
    q, k, v = split(silu(causal_conv1d([q | k | v])))        per request, over its saved inputs
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g = A * softplus(a + dt_bias), beta = sigmoid(b))
    out = out_proj(rmsnorm(o) * silu(z))                     per value head

Value heads come in groups: key head h serves value heads [h * r, (h + 1) * r). Tensor parallel
splits key heads, and with them their value heads, over the ranks: every projection segment
(q, k, v, z, b, a, the conv channels, A_log, dt_bias) is split on its own, out_proj is
row-parallel, and the state of a rank's heads stays on that rank.

It is a CachedLayer with one state spec: the conv state (the last kernel - 1 conv inputs,
stored [kernel - 1, conv_dim] so that the kernels read whole vectors of channels, and seen as
[conv_dim, kernel - 1]; model dtype) and the recurrent state ([value_heads, key_dim, value_dim],
--ssm-h-dtype) of each request.

Checkpoints lay the input projections out two ways, both mapped onto in_proj's segments by the
model's stacked_params: Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a are segments
(0, 1, 2), 3, 4 and 5; Qwen3-Next's in_proj_qkvz / in_proj_ba interleave them per key head
([q_h, k_h, v_h, z_h] for each h), which this layer's loader takes apart (shard ids "qkvz", "ba").
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.cache_config import CacheConfig
from metrale.config.model_config import ModelConfig
from metrale.distributed.parallel_state import get_tp_group
from metrale.layers.cache_spec import StateCacheSpec, StateTensorSpec
from metrale.layers.forward_context import get_forward_context
from metrale.layers.linear import MergedColumnParallelLinear, RowParallelLinear, divide, load_column_segments
from metrale.layers.norm import GatedRMSNorm

KIND = "gdn"


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        hf, tp = config.hf_config, get_tp_group()
        self.layer_index = layer_index
        self.tp = tp
        self.total_k_heads, self.total_v_heads = hf.linear_num_key_heads, hf.linear_num_value_heads
        if self.total_v_heads % self.total_k_heads:
            raise ValueError(f"linear-attention value heads ({self.total_v_heads}) must be a multiple of its key "
                             f"heads ({self.total_k_heads})")
        self.num_k_heads = divide(self.total_k_heads, tp.size, "number of linear-attention key heads")
        self.num_v_heads = divide(self.total_v_heads, tp.size, "number of linear-attention value heads")
        self.head_k_dim, self.head_v_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = hf.linear_conv_kernel_dim
        full_k, full_v = self.total_k_heads * self.head_k_dim, self.total_v_heads * self.head_v_dim
        self._conv_segments = [full_k, full_k, full_v]

        self.in_proj = MergedColumnParallelLinear(config.hidden_size, [full_k, full_k, full_v, full_v]
                                                  + [self.total_v_heads] * 2)
        self.in_proj.weight.weight_loader = self._load_in_proj
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel_size), requires_grad=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias.weight_loader = self.A_log.weight_loader = self._load_per_value_head
        # -exp(A_log) in float32, computed once the weights are in (process_weights_after_loading).
        self.register_buffer("A", torch.empty(self.num_v_heads, dtype=torch.float32), persistent=False)
        self.norm = GatedRMSNorm(self.head_v_dim, hf.rms_norm_eps)
        self.out_proj = RowParallelLinear(full_v, config.hidden_size, bias=False)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, kernel - 1] (a view), bound by the runner
        self.recurrent_state: torch.Tensor | None = None  # [slots, value_heads, key_dim, value_dim]

    # -- weights -----------------------------------------------------------------------------

    def _load_in_proj(self, param, loaded, shard_id):
        """Segment ids (Qwen3.5) or a Qwen3-Next tensor interleaved per key head: "qkvz" fills
        segments 0-3, "ba" segments 4-5."""
        if shard_id not in ("qkvz", "ba"):
            return MergedColumnParallelLinear.weight_loader(self.in_proj, param, loaded, shard_id)
        r, dk, dv = self.total_v_heads // self.total_k_heads, self.head_k_dim, self.head_v_dim
        widths, first = ([dk, dk, r * dv, r * dv], 0) if shard_id == "qkvz" else ([r, r], 4)
        for shard, part in enumerate(self._grouped(loaded, widths, f"in_proj_{shard_id}"), start=first):
            MergedColumnParallelLinear.weight_loader(self.in_proj, param, part, shard)

    def _grouped(self, loaded: torch.Tensor, widths: list[int], name: str) -> list[torch.Tensor]:
        """Rows interleaved per key head, [h][part][width] -> each part's rows for all heads."""
        per_head = sum(widths)
        if loaded.shape[0] != self.total_k_heads * per_head:
            raise ValueError(f"{name}: checkpoint rows {loaded.shape[0]} do not match "
                             f"{self.total_k_heads} key heads x {per_head}")
        parts = loaded.view(self.total_k_heads, per_head, -1).split(widths, dim=1)
        return [part.reshape(-1, loaded.shape[-1]) for part in parts]

    def _load_conv(self, param, loaded, shard_id=None):
        if tuple(loaded.shape[1:]) != (1, self.kernel_size):
            raise ValueError(f"conv1d weight shape {tuple(loaded.shape)} does not match "
                             f"({sum(self._conv_segments)}, 1, {self.kernel_size})")
        load_column_segments(param, loaded, self._conv_segments, self.tp, name="conv1d")

    def _load_per_value_head(self, param, loaded, shard_id=None):
        load_column_segments(param, loaded, [self.total_v_heads], self.tp, name="per-value-head parameter")

    def process_weights_after_loading(self) -> None:
        self.A.copy_(-self.A_log.float().exp())

    # -- the cache ---------------------------------------------------------------------------

    def cache_specs(self, config: CacheConfig) -> tuple[StateCacheSpec]:
        return (StateCacheSpec(KIND, (
            StateTensorSpec("conv", (self.kernel_size - 1, self.conv_dim), config.model_dtype),
            StateTensorSpec("recurrent", (self.num_v_heads, self.head_k_dim, self.head_v_dim),
                            config.ssm_state_dtype))),)

    def bind_caches(self, caches: tuple[torch.Tensor, ...] | None) -> None:
        if caches is None:
            self.conv_state = self.recurrent_state = None
            return
        conv, self.recurrent_state = caches
        self.conv_state = conv.transpose(1, 2)

    # -- the forward pass --------------------------------------------------------------------

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; positions are not used (the state is)."""
        if self.recurrent_state is None:
            raise RuntimeError(f"the state cache is not bound to the linear attention of layer {self.layer_index}")
        ctx = get_forward_context()
        backend, metadata = ctx.backends[KIND], ctx.metadata[KIND]
        tokens = hidden.shape[0]
        mixed, z, b, a = self.in_proj(hidden).split([self.conv_dim, self.value_dim, self.num_v_heads,
                                                     self.num_v_heads], dim=-1)
        mixed = backend.conv(mixed, self.conv1d.weight.view(self.conv_dim, self.kernel_size), None, self.conv_state,
                             metadata)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        out = backend.delta_rule(q.view(tokens, self.num_k_heads, self.head_k_dim),
                                 k.view(tokens, self.num_k_heads, self.head_k_dim),
                                 v.view(tokens, self.num_v_heads, self.head_v_dim), a, b, self.A, self.dt_bias,
                                 self.recurrent_state, metadata)
        return self.out_proj(self.norm(out.reshape(tokens, self.value_dim), z))
