"""Prompt lookup in the runner: the n-gram drafter of asynchronous scheduling.

The n-gram drafter proposes from a request's latest tokens. Scheduling synchronously, the host
has them when it plans, and the drafter runs there (engine/ngram_drafter.py). Under asynchronous
scheduling the step before has not been read when the next is planned, so the drafter runs in the
runner instead, on the device, after the rejection sampler, as MTP and DFlash do; the scheduler
plans the request over its verify step in flight with the drafts left on the device
(engine/scheduler.py). Its drafts are the host drafter's for the same tokens
(kernels/ngram_match.py): the same acceptance, the same tokens.

It keeps each request's tokens on the device: one row of `history` per running request (at most
max_num_seqs), written whole when the runner first sees the request (`admit`: the prompt and any
outputs, so a prefix hit's cached tokens are there too), then by every step: each computed row's
input id at its position, and the sampled token after each sampled request's last accepted
position. Rows past a request's known tokens (rejected drafts) hold stale ids the next steps
overwrite; the lookup reads only its known ones. No host sync: the history's rows and the
lengths stay on the device.
"""

from __future__ import annotations

import torch

from metrale.config.speculative_config import ngram_sha256
from metrale.executor.drafters.base import DraftInputs, DraftOutput, RunnerDrafter
from metrale.executor.sampler import column
from metrale.kernels.ngram_match import ngram_drafts
from metrale.messages.scheduler_output import PLACEHOLDER


def history_bytes(max_num_seqs: int, max_model_len: int) -> int:
    """The device bytes of the drafter's token history (int32, a position past the context)."""
    return max_num_seqs * (max_model_len + 1) * 4


class NgramRunnerDrafter(RunnerDrafter):
    method = "ngram"
    reads_hidden_states = False

    def __init__(self, k: int, prompt_lookup_min: int, prompt_lookup_max: int, max_model_len: int):
        self.k, self.min_n, self.max_n = k, prompt_lookup_min, prompt_lookup_max
        self.sha256 = ngram_sha256(prompt_lookup_min, prompt_lookup_max)
        self.max_model_len = max_model_len
        self.history: torch.Tensor | None = None  # int32 [max_num_seqs, max_model_len + 1]
        self.rows: dict[str, int] = {}
        self._free: list[int] = []

    def cached_layers(self) -> list:
        return []

    def allocate(self, max_num_seqs: int, device: torch.device) -> None:
        self.history = torch.zeros(max_num_seqs, self.max_model_len + 1, dtype=torch.int32, device=device)
        self.rows, self._free = {}, list(range(max_num_seqs - 1, -1, -1))
        if device.type == "cuda":  # compile the lookup now, not at the first request's first step
            one = torch.ones(1, dtype=torch.int64, device=device)
            ngram_drafts(self.history, one - 1, one, self.k, self.min_n, self.max_n)

    def admit(self, request_id: str, token_ids: list[int]) -> None:
        self.forget(request_id)  # a request seen again starts afresh
        if not self._free:
            raise RuntimeError(f"the n-gram drafter holds {len(self.rows)} requests, its history's size: "
                               "more running requests than max_num_seqs")
        row = self._free.pop()
        self.rows[request_id] = row
        known = token_ids.index(PLACEHOLDER) if PLACEHOLDER in token_ids else len(token_ids)
        self.history[row, :known] = column(token_ids[:known], torch.int32, self.history.device)

    def forget(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def propose(self, inputs: DraftInputs) -> DraftOutput:
        layout, device = inputs.layout, inputs.input_ids.device
        rows = column([self.rows[rid] for rid in inputs.seq_request_ids], torch.int64, device)
        num_rows = inputs.input_ids.shape[0]
        starts = layout.query_start_loc.long()
        row_seqs = torch.repeat_interleave(torch.arange(starts.shape[0] - 1, device=device), starts[1:] - starts[:-1],
                                           output_size=num_rows)
        self.history[rows[row_seqs], layout.positions] = inputs.input_ids.to(torch.int32)
        if not inputs.request_ids:
            return DraftOutput(torch.empty(0, self.k, dtype=torch.int64, device=device))
        sampled = rows[inputs.seq_index]
        after = layout.positions[inputs.last_rows] + 1  # the sampled token's position
        self.history[sampled, after] = inputs.sampled_tokens.to(torch.int32)
        return DraftOutput(ngram_drafts(self.history, sampled, after + 1, self.k, self.min_n, self.max_n))

