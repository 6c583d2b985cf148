"""The fused softmax top-k routing kernel against the PyTorch routing it replaces."""

import pytest
import torch

from metrale.kernels.moe_routing import softmax_topk_triton
from metrale.layers.moe.routing import select_experts


def _logits(tokens, experts, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=g) * 2).to(dtype=dtype, device=device)


@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (128, 8), (512, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_torch_routing(device, experts, top_k, renormalize):
    logits = _logits(5, experts, torch.float32, device)
    weights, ids = softmax_topk_triton(logits, top_k, renormalize)
    ref_weights, ref_ids = select_experts(logits.cpu(), top_k, "softmax", renormalize)
    assert torch.equal(ids.cpu(), ref_ids)  # distinct random logits: one top-k, largest first
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-6, atol=1e-7)


def test_bf16_logits_strided_rows_and_weights_in_the_model_dtype(device):
    g = torch.Generator().manual_seed(1)
    # Distinct in bf16 (equal logits would be a tie, which either order breaks correctly).
    wide = torch.stack([torch.randperm(96, generator=g) * 0.1 - 4 for _ in range(7)]).to(torch.bfloat16).to(device)
    logits = wide[:, :64]  # a strided view, as a slice of a fused projection would be
    weights, ids = softmax_topk_triton(logits, 4, True, torch.bfloat16)
    ref_weights, ref_ids = select_experts(logits.cpu(), 4, "softmax", True)
    assert weights.dtype == torch.bfloat16 and torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights.to(torch.bfloat16), rtol=0, atol=2 ** -8)


def test_ties_take_the_lowest_expert_id(device):
    logits = torch.zeros(2, 16, device=device)
    logits[1, [3, 9, 12]] = 5.0
    _, ids = softmax_topk_triton(logits, 3, True)
    assert ids[0].tolist() == [0, 1, 2] and ids[1].tolist() == [3, 9, 12]


def test_no_tokens(device):
    weights, ids = softmax_topk_triton(torch.empty(0, 32, device=device), 2, True)
    assert weights.shape == ids.shape == (0, 2)
