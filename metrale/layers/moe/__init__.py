"""Mixture-of-experts: the FusedMoE layer, its routing, kernels and checkpoint mapping (docs/moe.md)."""

from metrale.layers.moe.layer import FusedMoE
from metrale.distributed.moe_layout import MoEParallelLayout, get_moe_layout, init_moe_layout, layout_for_topology
from metrale.layers.moe.reference import fused_experts_reference
from metrale.layers.moe.routing import select_experts

__all__ = ["FusedMoE", "MoEParallelLayout", "fused_experts_reference", "get_moe_layout", "init_moe_layout",
           "layout_for_topology", "select_experts"]
