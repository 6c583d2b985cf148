"""The token embedding and the LM head, split over the TP ranks along the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.distributed.parallel_state import get_tp_group
from metrale.layers.linear import dense_linear


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the (padded) vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        rows = max(0, min(self.per_rank, loaded.shape[0] - self.start))
        if loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding width {loaded.shape[1]} does not match {param.shape[1]}")
        param.data[:rows].copy_(loaded[self.start:self.start + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False):
        super().__init__(vocab_size, hidden_size)
        if bias:
            raise NotImplementedError("an LM head with a bias is not supported yet")

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def set_dtype(self, dtype: torch.dtype) -> None:
        """Keep the head's weight, and so the logits, in `dtype` (--lm-head-dtype). A head tied to
        the embeddings gets its own copy; the embeddings keep the model dtype."""
        if self.weight.dtype != dtype:
            self.weight = nn.Parameter(self.weight.detach().to(dtype), requires_grad=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = dense_linear(hidden.to(self.weight.dtype), self.weight)
        return self.tp.all_gather_last_dim(logits)[..., :self.vocab_size]
