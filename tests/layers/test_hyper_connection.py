"""layers/hyper_connection.py against transformers' Glm5NextTextHyperConnection and GLM-5.3's
decoder-layer mixing, on random weights: collapse and expand equal to the reference bit for bit
in float32 and in bfloat16 (the weights computed in float32, the streams' dtype kept as
transformers keeps it), and the Sinkhorn-normalised comb close to doubly stochastic."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

from metrale.layers.hyper_connection import HyperConnection, HyperConnectionDims

HIDDEN, STREAMS, TOKENS = 32, 4, 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_and_expand_equal_transformers(dtype):
    config = Glm5NextTextConfig(hidden_size=HIDDEN, hc_mult=STREAMS, num_hidden_layers=1, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    reference = Glm5NextTextHyperConnection(config)
    with torch.no_grad():
        reference.fn.copy_(torch.randn(reference.fn.shape) * 0.1)
        reference.base.copy_(torch.randn(reference.base.shape))
        reference.scale.copy_(1.0 + torch.randn(3) * 0.3)
    reference.fn.data = reference.fn.data.to(dtype)  # the model dtype; base and scale stay float32
    ours = HyperConnection(HyperConnectionDims.of(config))
    for name in ("fn", "base", "scale"):
        getattr(ours, name).data = getattr(reference, name).data.clone()
    streams = torch.randn(TOKENS, STREAMS, HIDDEN).to(dtype)
    block_output = torch.randn(TOKENS, HIDDEN).to(dtype)

    with torch.no_grad():
        post, comb, collapsed = reference(streams.unsqueeze(0))
        expected = post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(0).unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams.unsqueeze(0))
        block_input, mixing = ours.collapse(streams)
        new_streams = HyperConnection.expand(block_output, streams, mixing)

    assert block_input.dtype == dtype and new_streams.dtype == dtype
    assert torch.equal(block_input, collapsed[0])
    assert torch.equal(new_streams, expected[0])
    comb = mixing[1]
    torch.testing.assert_close(comb.sum(-2), torch.ones(TOKENS, STREAMS), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(TOKENS, STREAMS), atol=1e-2, rtol=0)
