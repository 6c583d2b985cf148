"""FusedMoE: top-k routing, then every expert's SwiGLU over the tokens routed to it.

Expert weights are stacked per layer, gate and up fused as in the dense MLP:

    w13 [local_experts, 2 * local_intermediate, hidden]   rows [0, I) gate (w1), [I, 2I) up (w3)
    w2  [local_experts, hidden, local_intermediate]       down

where local_experts is this rank's contiguous expert range and local_intermediate its slice of
each expert (see distributed/moe_layout.py). Routing always runs over all experts (the router is
replicated; softmax routing is one fused launch on CUDA); assignments to experts held elsewhere
contribute zero and one all-reduce over the layout's group sums the partial outputs. Routing
options (routing.py): the scoring function, renormalisation, a correction bias, DeepSeek-V3's
group-limited choice (`num_expert_groups`, `topk_groups`) and `routed_scaling_factor`. On CUDA,
decode-sized batches (up to kernels/moe_gemv.MAX_TOKENS tokens) take per-assignment GEMVs and
larger ones the Triton grouped GEMM; other devices take the PyTorch loop.

Under FP8 quantization (layers/quantization/fp8_layers.py sets `fp8`) w13 and w2 are float8 with
`w13_weight_scale_inv` / `w2_weight_scale_inv`; the same loader takes the scales, one row per
weight row and one column per block of `column_unit` inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.kernels import moe_routing, use_triton
from metrale.distributed.moe_layout import MoEParallelLayout, get_moe_layout
from metrale.layers.deferred_weights import new_weight
from metrale.layers.moe.reference import fused_experts_reference
from metrale.layers.moe.routing import SCORING_FUNCTIONS, check_group_limit, select_experts

# Checkpoint projection -> our shard of w13/w2. Per-expert tensors are named either way
# (Qwen/DeepSeek: gate/up/down_proj; Mixtral/MiniMax: w1/w3/w2); transformers' in-memory layout
# stacks a whole layer as experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I].
EXPERT_SHARD_OF = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
STACKED_SHARD_OF = {"gate_up_proj": "w13", "down_proj": "w2"}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 scoring: str = "softmax", renormalize: bool = True, use_correction_bias: bool = False,
                 layout: MoEParallelLayout | None = None, reduce_results: bool = True,
                 num_expert_groups: int = 1, topk_groups: int = 1, routed_scaling_factor: float = 1.0,
                 swiglu_limit: float | None = None):
        """`swiglu_limit` (GLM-5.3): every expert's gate and up clamped before silu(gate) * up
        (the reference and the grouped Triton GEMM; FP8 experts with it are refused)."""
        super().__init__()
        self.swiglu_limit = swiglu_limit
        if scoring not in SCORING_FUNCTIONS:
            raise ValueError(f"unknown MoE scoring function {scoring!r}; expected one of {SCORING_FUNCTIONS}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and the number of experts ({num_experts})")
        check_group_limit(num_experts, top_k, num_expert_groups, topk_groups)
        self.num_experts, self.top_k = num_experts, top_k
        self.num_expert_groups, self.topk_groups = num_expert_groups, topk_groups
        self.routed_scaling_factor = routed_scaling_factor
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.scoring, self.renormalize, self.reduce_results = scoring, renormalize, reduce_results
        self.layout = layout or get_moe_layout()
        self.expert_start, self.expert_end = self.layout.expert_range(num_experts)
        self.inter_start, self.inter_end = self.layout.intermediate_slice(intermediate_size)
        num_local, local_inter = self.expert_end - self.expert_start, self.inter_end - self.inter_start
        self.local_intermediate = local_inter
        self.w13 = new_weight(num_local, 2 * local_inter, hidden_size)
        self.w2 = new_weight(num_local, hidden_size, local_inter)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.fp8 = None  # an Fp8Experts (layers/quantization/fp8_layers.py) when the experts are FP8
        if use_correction_bias:
            # Kept in float32 whatever the model dtype: it only ranks experts, and small gaps matter.
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

    @property
    def expert_range(self) -> tuple[int, int]:
        return self.expert_start, self.expert_end

    def holds_expert(self, expert_id: int) -> bool:
        return self.expert_start <= expert_id < self.expert_end

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        """Copy this rank's part of one checkpoint tensor. shard_id "w1" (gate), "w3" (up) or "w2"
        (down) with a global expert_id for a per-expert tensor [I, H] / [H, I]; with expert_id None,
        "w13" [E, 2I, H] or "w2" [E, H, I] for a whole layer stacked. Other ranks' experts are skipped."""
        if expert_id is None:
            self._load_stacked(param, loaded, shard_id)
            return
        unit = getattr(param, "column_unit", 1)  # a scale: one column per `unit` inputs
        full_i, hidden = self.intermediate_size, self.hidden_size
        expected = (hidden, -(-full_i // unit)) if shard_id == "w2" else (full_i, -(-hidden // unit))
        if shard_id not in ("w1", "w3", "w2"):
            raise ValueError(f"unknown expert shard {shard_id!r}")
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert_id} {shard_id}: checkpoint shape {tuple(loaded.shape)} "
                             f"does not match {expected}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} is out of range for {self.num_experts} experts")
        if not self.holds_expert(expert_id):
            return
        local, size = expert_id - self.expert_start, self.local_intermediate
        if shard_id == "w2":
            param.data[local].copy_(loaded.narrow(1, self.inter_start // unit, param.shape[2]))
        else:
            offset = 0 if shard_id == "w1" else size
            param.data[local].narrow(0, offset, size).copy_(loaded.narrow(0, self.inter_start, size))

    def _load_stacked(self, param, loaded, shard_id):
        full_i, hidden, experts = self.intermediate_size, self.hidden_size, self.num_experts
        expected = {"w13": (experts, 2 * full_i, hidden), "w2": (experts, hidden, full_i)}.get(shard_id)
        if expected is None:
            raise ValueError(f"unknown stacked expert shard {shard_id!r}")
        if tuple(loaded.shape) != expected:
            raise ValueError(f"stacked {shard_id}: checkpoint shape {tuple(loaded.shape)} does not match {expected}")
        for expert in range(self.expert_start, self.expert_end):
            if shard_id == "w2":
                self.weight_loader(param, loaded[expert], "w2", expert)
            else:
                self.weight_loader(param, loaded[expert, :full_i], "w1", expert)
                self.weight_loader(param, loaded[expert, full_i:], "w3", expert)

    def process_weights_after_loading(self) -> None:
        if self.fp8 is not None:
            self.fp8.finish_loading(self)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers rounds softmax routing weights to the model dtype; sigmoid ones stay float32.
        dtype = router_logits.dtype if self.scoring == "softmax" else torch.float32
        return select_experts(router_logits, self.top_k, self.scoring, self.renormalize, self.e_score_correction_bias,
                              dtype, self.num_expert_groups, self.topk_groups, self.routed_scaling_factor)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, num_experts] -> [T, H], summed over the layout's ranks."""
        return self._experts_of(hidden, *self.route(router_logits))

    def forward_routed_by(self, hidden: torch.Tensor, router: nn.Module) -> torch.Tensor:
        """`self(hidden, router(hidden))` for a plain linear router (its `weight` [E, H], no bias,
        in the model dtype). On CUDA, for the decode batches that take the small-batch GEMVs with
        plain softmax routing, the router's GEMV and the top-k are one launch
        (kernels/moe_routing.router_softmax_topk_triton)."""
        if self._fuses_router(hidden, router):
            topk_weights, topk_ids = moe_routing.router_softmax_topk_triton(
                hidden, router.weight, self.top_k, self.renormalize, hidden.dtype)
            return self._experts_of(hidden, topk_weights, topk_ids)
        return self(hidden, router(hidden))

    def _fuses_router(self, hidden: torch.Tensor, router: nn.Module) -> bool:
        from metrale.kernels.moe_gemv import use_small_batch

        weight = getattr(router, "weight", None)
        return (self.scoring == "softmax" and self.e_score_correction_bias is None and self.num_expert_groups == 1
                and self.routed_scaling_factor == 1.0 and getattr(router, "bias", None) is None
                and getattr(router, "fp8", None) is None and isinstance(weight, torch.Tensor)
                and weight.dtype == hidden.dtype and weight.shape == (self.num_experts, self.hidden_size)
                and hidden.dim() == 2 and hidden.stride(1) == 1 and use_triton(hidden)
                and moe_routing.supports(self.num_experts, self.top_k)
                and use_small_batch(hidden.shape[0], self.local_intermediate))

    def _experts_of(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            if self.swiglu_limit is not None:
                raise NotImplementedError("FP8 experts with a swiglu_limit (GLM-5.3) are not implemented")
            out = self.fp8.experts(self, hidden, topk_weights, topk_ids)
        elif self.swiglu_limit is not None:
            out = self._experts(hidden, clamped=True)(hidden, self.w13, self.w2, topk_weights, topk_ids,
                                                      self.expert_start, swiglu_limit=self.swiglu_limit)
        else:
            out = self._experts(hidden)(hidden, self.w13, self.w2, topk_weights, topk_ids, self.expert_start)
        return self.layout.reduce_group.all_reduce(out) if self.reduce_results else out

    def _experts(self, hidden: torch.Tensor, clamped: bool = False):
        """`clamped`: an implementation that takes swiglu_limit (not the small-batch GEMVs)."""
        if not use_triton(hidden):
            return fused_experts_reference
        from metrale.kernels.moe_gemv import fused_experts_small_batch_triton, use_small_batch
        from metrale.layers.moe.triton_moe import fused_experts_triton

        if clamped:
            return fused_experts_triton

        # Decode-sized batches: per-assignment GEMVs; larger ones: the grouped GEMM.
        small = use_small_batch(hidden.shape[0], self.local_intermediate)
        return fused_experts_small_batch_triton if small else fused_experts_triton

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (local {self.expert_start}..{self.expert_end - 1}), top_k={self.top_k}, "
                f"hidden={self.hidden_size}, intermediate={self.intermediate_size} (local {self.local_intermediate}), "
                f"scoring={self.scoring}, renormalize={self.renormalize}"
                + (f", groups={self.topk_groups} of {self.num_expert_groups}" if self.num_expert_groups > 1 else "")
                + (f", scaling={self.routed_scaling_factor}" if self.routed_scaling_factor != 1.0 else ""))
