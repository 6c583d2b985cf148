"""Manifold-constrained hyper-connections (mHC, GLM-5.3): the residual stream widened into
`hc_mult` parallel streams, mixed around every block (attention or MLP) by weights computed
from the streams themselves. As transformers' Glm5NextTextHyperConnection:

    streams    [T, N, D]                       N = hc_mult residual streams per token
    x          = rms(flatten(streams))         float32, no weight, eps = rms_norm_eps
    [p | q | c] = fn @ x                        fn [(2 + N) * N, N * D]
    pre        = sigmoid(p * scale[0] + base_p) + hc_eps                   [T, N]
    post       = 2 * sigmoid(q * scale[1] + base_q)                        [T, N]
    comb       = softmax(c * scale[2] + base_c, rows) + hc_eps             [T, N, N]
                 then Sinkhorn-normalised (columns, then rows and columns hc_sinkhorn_iters - 1
                 times), so it is close to doubly stochastic
    block in   = sum_i pre[i] * streams[i]                                  [T, D]
    streams'[j] = post[j] * block(block in) + sum_i comb[i, j] * streams[i]

The weights are computed in float32 whatever the model dtype; `fn` is stored in the model dtype
(the checkpoint's) and `base`, `scale` in float32, as transformers keeps them. Every rank holds
all of it (it is small: (2 + N) * N rows) and computes the same weights, so nothing is
communicated; the block between collapse and expand is what runs in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HyperConnectionDims:
    hidden_size: int
    streams: int  # hc_mult
    sinkhorn_iters: int
    eps: float  # hc_eps: the floor added to pre and comb and to every Sinkhorn denominator
    norm_eps: float  # the unweighted RMS norm's (rms_norm_eps)

    @classmethod
    def of(cls, hf) -> "HyperConnectionDims":
        return cls(hf.hidden_size, hf.hc_mult, hf.hc_sinkhorn_iters, hf.hc_eps, hf.rms_norm_eps)


class HyperConnection(nn.Module):
    """One mixing site (a layer has two: before attention and before the MLP). Parameter names
    are transformers' in-memory ones (fn, base, scale); GLM's checkpoints store them as
    hc_attn_fn / hc_ffn_fn etc., which the model renames."""

    def __init__(self, dims: HyperConnectionDims):
        super().__init__()
        self.dims = dims
        n = dims.streams
        rows = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(rows, n * dims.hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def mixing_weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> pre [T, N], post [T, N], comb [T, N, N], all float32."""
        d, n = self.dims, self.dims.streams
        x = streams.reshape(streams.shape[0], -1).float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + d.norm_eps)
        p, q, c = torch.nn.functional.linear(x, self.fn.float()).split([n, n, n * n], dim=-1)
        base_p, base_q, base_c = self.base.split([n, n, n * n])
        scale_p, scale_q, scale_c = self.scale.unbind(0)
        pre = torch.sigmoid(p * scale_p + base_p) + d.eps
        post = 2 * torch.sigmoid(q * scale_q + base_q)
        comb = torch.softmax(c.view(-1, n, n) * scale_c + base_c.view(n, n), dim=-1) + d.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + d.eps)
        for _ in range(d.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + d.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + d.eps)
        return pre, post, comb

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """streams [T, N, D] -> (the block's input [T, D] in the streams' dtype, what `expand`
        needs: (post, comb))."""
        pre, post, comb = self.mixing_weights(streams)
        block_input = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return block_input, (post, comb)

    @staticmethod
    def expand(block_output: torch.Tensor, streams: torch.Tensor,
               weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The block's output [T, D] and the streams it read [T, N, D] -> the new streams
        [T, N, D]: post[j] * output + sum_i comb[i, j] * streams[i], in the model dtype (as
        transformers rounds the weights first)."""
        post, comb = weights
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams)
