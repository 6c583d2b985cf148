"""CUDA graphs of the decode step.

A pure decode step (one new token for each running sequence) is the same forward pass every
time, only the numbers in its inputs change. It is captured once per batch size in
`capture_sizes` (1, 2, 4, 8, then steps of 8 up to max_num_seqs), all graphs sharing one memory
pool, over static input buffers. A step of n sequences replays the smallest graph of at least n,
with the extra rows padded: slot -1 (no KV write), sequence length 0 (no KV read) and the padding
state slot (state kinds read and write a slot no request owns).
Prefill and mixed steps, and batches larger than the largest graph, run eagerly.
"""

from __future__ import annotations

import logging

import torch

from metrale.layers.forward_context import BatchLayout, set_forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
    return sorted({min(s, max_num_seqs) for s in sizes} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int):
        self.runner, self.model, self.device = runner, runner.model, runner.device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        n, device = self.max_batch, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        # The static BatchLayout every graph reads: a replay copies the step's layout in.
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.state_slots = torch.full((n,), runner.padding_slot, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0

    def _layout(self, batch: int) -> BatchLayout:
        return BatchLayout(
            positions=self.positions[:batch], query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:batch], state_slots=self.state_slots[:batch],
            has_initial_state=self.has_initial_state[:batch], max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * batch, seq_lens_cpu=[1] * batch, is_pure_decode=True)

    def _forward(self, batch: int) -> torch.Tensor:
        layout = self._layout(batch)
        with set_forward_context(self.runner.forward_context(layout)):
            hidden = self.model(self.input_ids[:batch], layout.positions)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        before = torch.cuda.memory_reserved(self.device)
        pool = None
        for batch in reversed(self.sizes):  # largest first: the smaller graphs fit in its pool
            self._forward(batch)  # warm-up: autotuning and lazy initialisation happen outside capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[batch] = self._forward(batch)
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("captured %d decode CUDA graphs (batch sizes %s..%s), %.0f MiB", len(self.graphs),
                    self.sizes[0], self.sizes[-1], self.memory_bytes / 2**20)

    def release(self) -> None:
        """Free the graphs. Must come before the NCCL process groups are torn down: a live graph
        holding captured collectives makes that teardown hang (pytorch/pytorch#115388)."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    def run(self, input_ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """Logits [n, vocab] of a pure decode step of n sequences."""
        n = input_ids.shape[0]
        batch = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(layout.positions)
        self.slot_mapping[:n].copy_(layout.slot_mapping)
        self.seq_lens[:n].copy_(layout.seq_lens)
        self.state_slots[:n].copy_(layout.state_slots)
        width = layout.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(layout.block_tables)
        if batch > n:
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].fill_(0)
            self.state_slots[n:batch].fill_(self.runner.padding_slot)
        self.graphs[batch].replay()
        return self.logits[batch][:n]
