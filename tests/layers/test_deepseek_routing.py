"""DeepSeek-V3 routing in the shared MoE layer: group-limited top-k over sigmoid scores with a
correction bias, renormalisation and routed_scaling_factor, against transformers' own router."""

from __future__ import annotations

import pytest
import torch

from metrale.layers.moe import FusedMoE, select_experts


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_group_limited_routing_matches_transformers(norm_topk_prob):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                              norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        router.e_score_correction_bias.copy_(torch.rand(16, generator=g))
    hidden = torch.randn(200, 32, generator=g)
    logits, expected_weights, expected_ids = router(hidden)
    weights, ids = select_experts(logits, 4, "sigmoid", norm_topk_prob, router.e_score_correction_bias,
                                  num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    weights, ids = _sorted(weights, ids)
    expected_weights, expected_ids = _sorted(expected_weights, expected_ids)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=0)


def test_the_best_expert_of_a_losing_group_is_not_chosen():
    # Groups of two: {0,1} scores 0.9 + 0.0, {2,3} 0.6 + 0.6, {4,5} 0.5 + 0.5: the top group is {2,3}.
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.6, 0.5, 0.5]])
    logits = torch.logit(scores)
    _, ids = select_experts(logits, 2, "sigmoid", renormalize=False, num_expert_groups=3, topk_groups=1)
    assert sorted(ids[0].tolist()) == [2, 3]
    _, ids = select_experts(logits, 2, "sigmoid", renormalize=False)  # no groups: expert 0 wins
    assert 0 in ids[0].tolist()


def test_routed_scaling_factor_scales_the_final_weights():
    logits = torch.randn(5, 8)
    plain, ids = select_experts(logits, 2, "sigmoid", renormalize=True)
    scaled, scaled_ids = select_experts(logits, 2, "sigmoid", renormalize=True, routed_scaling_factor=2.5)
    assert torch.equal(ids, scaled_ids)
    torch.testing.assert_close(scaled, plain * 2.5)
    torch.testing.assert_close(scaled.sum(-1), torch.full((5,), 2.5))


@pytest.mark.parametrize("groups, topk_groups, top_k, message", [
    (3, 1, 2, "do not split into 3 equal"), (8, 2, 2, "groups of 1 expert"),
    (4, 5, 2, "topk_groups .5. must be between"), (4, 1, 3, "exceeds the 2 experts")])
def test_group_limits_that_cannot_route_are_refused(groups, topk_groups, top_k, message):
    with pytest.raises(ValueError, match=message):
        FusedMoE(8, top_k, 16, 16, scoring="sigmoid", use_correction_bias=True, num_expert_groups=groups,
                 topk_groups=topk_groups)
