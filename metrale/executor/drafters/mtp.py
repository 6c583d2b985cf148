"""The MTP (next-n) drafter: the target model's own multi-token-prediction layer proposes drafts.

Every step that computes tokens, the layer (`model.mtp[0]`: DeepSeek's / GLM's next-n layer,
models/mtp.py, or the `mtp.*` layer of Qwen3-Next / Qwen3.5 and of met's dense layout for Llama /
Qwen2 / Qwen3, models/qwen_mtp.py: both take the
same inputs and give a hidden state and logits) runs over all of the
step's rows with the trunk's final hidden states and the token after each row
(`DraftInputs.next_token_ids`), at the rows' positions, over its own paged cache: a prefill fills
that cache over every prompt position, so later drafts attend to the whole context. At each
sampled request's last accepted row its logits give draft 1 (the token two positions on).

Chained for k > 1: draft j + 1 comes from the same layer, one row per request at the position
after draft j's, with the layer's own hidden state of the previous pass and draft j as input
(DeepSeek's and Qwen's published checkpoints hold one MTP layer, and every chained pass reuses
it). On hybrid targets the MTP layer is attention only; the target's recurrent state is rolled
back by the verify step's scratch slots, as for any drafter. A chained pass writes the layer's cache at positions past the step's
last computed one (`lookahead_tokens` = k - 1, which the scheduler reserves); those entries are
overwritten when the trunk computes the positions. No pass waits for the device: the rows'
positions stay there, and the host lays the passes out with upper bounds of their lengths. A
draft stops where its request's blocks end.

Drafts are the layer's argmax (point masses: the rejection sampler's n-gram rule), under greedy
and sampled requests alike: lossless either way, since the verifier decides.
"""

from __future__ import annotations

import logging

import torch

from metrale.executor.drafters.base import DraftInputs, DraftOutput, RunnerDrafter
from metrale.layers.forward_context import BatchLayout, DeviceLengths, set_forward_context

logger = logging.getLogger(__name__)


class MTPDrafter(RunnerDrafter):
    method = "mtp"

    def __init__(self, model: torch.nn.Module, k: int, max_model_len: int, block_size: int):
        layers = getattr(model, "mtp", None)
        if not layers:
            raise ValueError("MTP drafting needs the checkpoint's multi-token-prediction layers, and this model has "
                             "none")
        self.model, self.layer, self.k = model, layers[0], k
        self.sha256 = getattr(model, "mtp_sha256", None)
        self.lookahead_tokens = k - 1
        self.max_model_len, self.block_size = max_model_len, block_size

    def cached_layers(self) -> list:
        return self.layer.cached_layers()

    def _logits(self, hidden: torch.Tensor, vocab: int | None) -> torch.Tensor:
        logits = self.layer.compute_logits(hidden, self.model.lm_head)
        return logits[:, :vocab] if vocab is not None else logits

    def propose(self, inputs: DraftInputs) -> DraftOutput:
        layout, embed = inputs.layout, self.model.model.embed_tokens
        with set_forward_context(inputs.forward_context(layout)):
            hidden = self.layer(layout.positions, inputs.next_token_ids, inputs.hidden, embed)
        num_sampled = len(inputs.request_ids)
        drafts = torch.full((num_sampled, self.k), -1, dtype=torch.int64, device=inputs.hidden.device)
        if not num_sampled:
            return DraftOutput(drafts)
        hidden = hidden[inputs.last_rows]
        token = self._logits(hidden, inputs.sampled_vocab_size).argmax(dim=-1)
        drafts[:, 0] = token
        if self.k > 1:
            self._chain(inputs, hidden, token, drafts)
        return DraftOutput(drafts)

    def _chain(self, inputs: DraftInputs, hidden: torch.Tensor, token: torch.Tensor, drafts: torch.Tensor) -> None:
        """Drafts 2..k, one row per sampled request per pass; a request's draft ends where its
        blocks (or the context) end. Its rows' positions stay on the device (no host sync): the
        host lays the passes out with upper bounds of their lengths."""
        layout, device, bs = inputs.layout, hidden.device, self.block_size
        seqs = inputs.seq_index
        tables = layout.block_tables[seqs]
        last = layout.positions[inputs.last_rows]
        room = inputs.capacity.clamp(max=self.max_model_len)
        bounds = [layout.seq_len_bounds[s] for s in inputs.seq_index_cpu]  # >= each last row's position + 1
        n = len(bounds)
        query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        has_state = torch.ones(n, dtype=torch.int32, device=device)
        for j in range(1, self.k):
            positions = last + j
            fits = positions < room
            positions = torch.where(fits, positions, 0)
            blocks = tables.gather(1, (positions // bs)[:, None].to(tables.dtype)).squeeze(1).long()
            slots = torch.where(fits, blocks * bs + positions % bs, -1)
            bounds_j = [b + j for b in bounds]
            step = BatchLayout(
                positions=positions, query_start_loc=query_start, seq_lens=(positions + 1).to(torch.int32),
                block_tables=tables, slot_mapping=slots, state_slots=layout.state_slots[seqs],
                has_initial_state=has_state, max_query_len=1, max_seq_len=max(bounds_j), query_lens_cpu=[1] * n,
                seq_lens_cpu=DeviceLengths((positions + 1).to(torch.int32)), is_pure_decode=True,
                seq_len_bounds_cpu=bounds_j)
            with set_forward_context(inputs.forward_context(step)):
                hidden = self.layer(positions, token, hidden, self.model.model.embed_tokens)
            token = self._logits(hidden, inputs.sampled_vocab_size).argmax(dim=-1)
            # A draft is a prefix: once a request's row does not fit, its later drafts stay -1.
            keep = fits & (drafts[:, j - 1] >= 0)
            drafts[:, j] = torch.where(keep, token, -1)
