"""Mixture-of-experts: the FusedMoE layer, its routing, kernels and checkpoint mapping (docs/moe.md)."""

from metrale.layers.moe.layer import FusedMoE
from metrale.layers.moe.parallel import MoEParallelLayout, get_moe_layout
from metrale.layers.moe.reference import fused_experts_reference
from metrale.layers.moe.routing import select_experts

__all__ = ["FusedMoE", "MoEParallelLayout", "get_moe_layout", "fused_experts_reference", "select_experts"]
