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


# The router's GEMV and the top-k in one launch (router_softmax_topk_triton): the logits' last
# program to arrive takes the top-k.
@pytest.mark.parametrize("tokens,experts,top_k,hidden", [(1, 8, 2, 64), (3, 60, 4, 96), (16, 128, 8, 48),
                                                         (2, 512, 10, 32)])
def test_fused_router_matches_linear_then_routing(device, tokens, experts, top_k, hidden):
    from metrale.kernels.arrivals import arrival_counters
    from metrale.kernels.moe_routing import router_softmax_topk_triton

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(device)
    w = torch.randn(experts, hidden, generator=g).to(device)
    weights, ids = router_softmax_topk_triton(x, w, top_k, True)
    ref_weights, ref_ids = select_experts(torch.nn.functional.linear(x, w).cpu(), top_k, "softmax", True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-5, atol=1e-6)
    again = router_softmax_topk_triton(x, w, top_k, True)  # the counters went back to zero
    assert torch.equal(again[1], ids) and torch.equal(again[0], weights)
    assert not arrival_counters(x.device, tokens).any()


def test_fused_router_bf16_strided_rows(device):
    from metrale.kernels.moe_routing import router_softmax_topk_triton

    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 160, generator=g).to(torch.bfloat16).to(device)
    x = wide[:, :128]  # rows strided, as a slice would be
    w = (torch.randn(32, 128, generator=g) * 0.1).to(torch.bfloat16).to(device)
    weights, ids = router_softmax_topk_triton(x, w, 4, False, torch.bfloat16)
    # the reference rounds the logits to bf16 (F.linear's output) before the softmax
    ref_weights, ref_ids = select_experts(torch.nn.functional.linear(x.float(), w.float()).to(torch.bfloat16).cpu(),
                                          4, "softmax", False)
    assert weights.dtype == torch.bfloat16 and torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights.to(torch.bfloat16), rtol=0, atol=2 ** -7)
