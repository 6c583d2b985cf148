"""CUDA graphs of the decode step and of the verify step (speculative decoding).

A pure decode step (one new token for each running sequence) is the same forward pass every
time, only the numbers in its inputs change. It is captured once per batch size in
`capture_sizes` (1, 2, 4, 8, then steps of 8 up to max_num_seqs), all graphs sharing one memory
pool, over static input buffers. A step of n sequences replays the smallest graph of at least n,
with the extra rows padded: slot -1 (no KV write), sequence length 0 (no KV read) and the padding
state slot (state kinds read and write a slot no request owns).

A verify step (requests with k drafts computed over 1 + k positions) has the same shape once
every sequence is given the same number of query rows q: sequence i owns rows i*q .. i*q+q-1,
of which the first query_len_i are real (its last token and its drafts; a request without
drafts in the step has one). The others are dummy rows: slot -1, the position of the sequence's
last real row, results ignored (`VerifyRows`). Graphs are captured for every q from 2 to
1 + num_speculative_tokens (`VerifyGraphSet`); a step takes the smallest q that holds its
longest sequence, padding the shorter ones. The layout says so
(BatchLayout.uniform_query_len, real_query_lens), and only backends that read it
(`supports_verify_graphs`: the Triton attention and MLA backends, through their multi-query decode)
take part: a model with another kind of cache (Gated DeltaNet state, DSA's indexer) verifies
eagerly. Verify graphs are captured per batch size up to max_num_seqs sequences and
`verify_row_limit` rows in all (at least max_num_seqs, at most 512 unless max_num_seqs is more,
and never more than a step's token budget), into the decode graphs' pool; the memory plan reserves
logits for max_num_seqs x (1 + k) rows where the engine speculates (startup/memory.py).

A verify graph also computes the greedy rule on its drafts (the drafts are its own input ids:
rejection_sampler.verify_greedy_padded), so a step whose rows are all greedy, with nothing that
changes their logits, takes its tokens and accepted counts from the graph with no sampler work on
the host (ModelRunner._verdict_settles). Its layout is built on the host and copied in whole.

A prefill graph runs one fresh sequence's whole prompt (no cached prefix, one chunk) padded to
a token bucket T (`prefill_capture_sizes`: powers of two up to 1024): the eager prefill's time
goes to launching its ~500 kernels from Python, not to running them. Rows L..T-1 after the
prompt's L tokens are padding: token 0 at positions L..T-1, slot -1 (no KV write), and the
sequence is T long, so under the causal mask the real rows see exactly the keys they would
eagerly; the padding rows read keys nobody wrote and their results are never read (every layer
but attention is row-wise). The graph gathers the last real row's hidden state (a device index)
for the logits. Only backends that say `supports_prefill_graphs` (the Triton attention backend)
take part, for models without MoE layers, M-RoPE or a runner-side drafter. FP8 linear layers pick
their kernel by row count, so a quantized model's graphs take prompts of at least
`min_tokens` (kernels/fp8_linear.rows_on_one_path: 2 with activations quantized, where one row
would take the W8A16 GEMV); shorter prompts prefill eagerly.

Other prefill and mixed steps, and batches larger than the largest graph, run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from metrale.executor.rejection_sampler import verify_drafts, verify_greedy_padded
from metrale.executor.sampler import SamplingRow
from metrale.layers.forward_context import BatchLayout, set_forward_context
from metrale.messages.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
    return sorted({min(s, max_num_seqs) for s in sizes} | {max_num_seqs})


# The most rows a verify graph holds where max_num_seqs is smaller: vLLM's default CUDA-graph
# capture limit, in tokens. Larger verify steps are rare (the cost model drafts less as the batch
# grows) and run eagerly.
VERIFY_GRAPH_ROWS = 512


def verify_row_limit(max_num_seqs: int, step_token_budget: int) -> int:
    """The most rows (sequences x (1 + k)) a verify graph holds: max_num_seqs, or more up to
    VERIFY_GRAPH_ROWS, within the step's token budget (no step has more rows)."""
    return max(max_num_seqs, min(VERIFY_GRAPH_ROWS, step_token_budget))


def verify_capture_sizes(max_num_seqs: int, num_speculative_tokens: int, max_rows: int) -> list[int]:
    """The verify graphs' batch sizes: the decode graphs' sizes whose sequences of (1 + k) rows
    each take at most max_rows rows, at least batch 1."""
    rows = 1 + num_speculative_tokens
    return [s for s in capture_sizes(max_num_seqs) if s * rows <= max_rows] or [1]


@dataclass
class VerifyRows:
    """Where a verify step's ragged rows go in a graph of `query_len` rows per sequence."""

    padded_rows: np.ndarray  # int64 [num_tokens]: ragged row r of sequence i -> i * query_len + t
    positions: np.ndarray  # int64 [num_seqs * query_len]; a dummy row repeats its sequence's last position


def verify_rows(query_lens: list[int], seq_lens: list[int], query_len: int) -> VerifyRows:
    lens = np.asarray(query_lens, dtype=np.int64)
    t = np.arange(query_len, dtype=np.int64)
    real = t[None, :] < lens[:, None]  # [num_seqs, query_len]
    padded_rows = np.flatnonzero(real.ravel())  # row-major: sequence by sequence, in ragged order
    first = np.asarray(seq_lens, dtype=np.int64) - lens
    positions = first[:, None] + np.minimum(t[None, :], lens[:, None] - 1)
    return VerifyRows(padded_rows, positions.ravel())


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """The prefill graphs' token buckets: powers of two from 16 up to max_tokens, at most 1024
    (a graph's activations live in the graphs' pool on top of the memory plan's reserve)."""
    top = min(max_tokens, 1024)
    return [1 << i for i in range(4, 11) if 1 << i <= top]


def fits_verify_graph(query_lens: list[int], seq_lens: list[int], num_sampled_rows: int, query_len: int) -> bool:
    """A step a verify graph can run: every sequence continues a computed context with at most
    query_len rows, and every row's logits are sampled (decodes and drafts only, no prefill)."""
    return (num_sampled_rows == sum(query_lens) and max(query_lens) <= query_len
            and all(s > n for n, s in zip(query_lens, seq_lens)))


class GraphOutputs(NamedTuple):
    """What one captured graph computes, in its static output tensors."""

    hidden: torch.Tensor  # [rows, hidden]: the trunk's final hidden states (what compute_logits read)
    logits: torch.Tensor  # [rows, vocab]
    # Verify graphs: int64 [2, batch], the greedy rule on every sequence's drafts (the token after
    # the accepted drafts, how many were accepted: rejection_sampler.verify_greedy_padded).
    verdict: torch.Tensor | None = None


class Replayed:
    """A replay's results for the step's own rows, in its row order. Gathered from the graph's
    padded rows only when read: a verify step the greedy verdict settles never copies its logits."""

    def __init__(self, outputs: GraphOutputs, rows: torch.Tensor | int, num_seqs: int,
                 logits_sampled: bool = False):
        """`rows`: the step's rows among the graph's (a device index), or a count: its rows are
        the graph's first `rows`. `logits_sampled`: the graph's logits are the step's sampled
        rows already (a prefill graph's one row)."""
        self._outputs, self._rows, self.num_seqs = outputs, rows, num_seqs
        self._logits_sampled = logits_sampled

    def _take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[:self._rows] if isinstance(self._rows, int) else tensor[self._rows]

    @cached_property
    def logits(self) -> torch.Tensor:
        return self._outputs.logits if self._logits_sampled else self._take(self._outputs.logits)

    @cached_property
    def hidden(self) -> torch.Tensor:
        return self._take(self._outputs.hidden)

    @property
    def verdict(self) -> torch.Tensor | None:
        """int64 [2, num_seqs] (verify graphs; None for decode graphs): GraphOutputs.verdict."""
        v = self._outputs.verdict
        return v[:, :self.num_seqs] if v is not None else None


class CapturedGraphs:
    """One graph per size over shared static buffers (what a subclass's `_forward(size)` reads),
    captured into one memory pool; the subclass copies a step in and replays."""

    kind = ""
    size_name = ""

    def __init__(self, runner, sizes: list[int], max_model_len: int, query_len: int):
        self.runner, self.model, self.device = runner, runner.model, runner.device
        self.sizes = sizes
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.query_len = query_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per graph, its outputs. Overwritten by the next replay, which the stream orders after
        # every read enqueued before it (a runner-side MTP drafter reads `hidden` after the replay).
        self.outputs: dict[int, GraphOutputs] = {}
        self.memory_bytes = 0

    def _staging(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped as a static buffer, pinned on CUDA (copied in without blocking)."""
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every size (into `pool` when given); returns the pool the graphs share."""
        before = torch.cuda.memory_reserved(self.device)
        for batch in reversed(self.sizes):  # largest first: the smaller graphs fit in its pool
            self._forward(batch)  # warm-up: autotuning and lazy initialisation happen outside capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("captured %d %s CUDA graphs (%s %s..%s, %d rows per sequence), %.0f MiB",
                    len(self.graphs), self.kind, self.size_name, self.sizes[0], self.sizes[-1], self.query_len,
                    self.memory_bytes / 2**20)
        return pool

    def release(self) -> None:
        """Free the graphs. Must come before the NCCL process groups are torn down: a live graph
        holding captured collectives makes that teardown hang (pytorch/pytorch#115388)."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def _forward(self, size: int) -> GraphOutputs:
        raise NotImplementedError


class DecodeGraphs(CapturedGraphs):
    """Graphs of steps whose sequences own `query_len` rows each: pure decode (1) or verify (1 + k)."""

    kind = "decode"
    size_name = "batch sizes"

    def __init__(self, runner, sizes: list[int], max_blocks_per_seq: int, max_model_len: int, query_len: int = 1):
        super().__init__(runner, sizes, max_model_len, query_len)
        n, rows, device = self.max_batch, self.max_batch * query_len, self.device
        # The static BatchLayout every graph reads: a replay copies the step's layout in. The
        # per-row and the per-sequence buffers are rows of one tensor each, so a step built on the
        # host fills each in one copy (VerifyGraphs.run).
        self.row_buffers = torch.zeros(3, rows, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.row_buffers.unbind(0)
        self.slot_mapping.fill_(-1)
        self.seq_buffers = torch.zeros(3, n, dtype=torch.int32, device=device)
        self.seq_lens, self.real_query_lens, self.state_slots = self.seq_buffers.unbind(0)
        self.real_query_lens.fill_(1)
        self.state_slots.fill_(runner.padding_slot)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device) * query_len
        self.has_initial_state = torch.ones(n, dtype=torch.int32, device=device)

    def _layout(self, batch: int) -> BatchLayout:
        q, rows = self.query_len, batch * self.query_len
        return BatchLayout(
            positions=self.positions[:rows], query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:rows], state_slots=self.state_slots[:batch],
            has_initial_state=self.has_initial_state[:batch], max_query_len=q, max_seq_len=self.max_model_len,
            query_lens_cpu=[q] * batch, seq_lens_cpu=[q] * batch, is_pure_decode=q == 1,
            uniform_query_len=q if q > 1 else 0, real_query_lens=self.real_query_lens[:batch] if q > 1 else None)

    def _forward(self, batch: int) -> GraphOutputs:
        """The outputs of every row of the graph of `batch` sequences."""
        layout = self._layout(batch)
        with set_forward_context(self.runner.forward_context(layout)):
            hidden = self.model(self.input_ids[:batch * self.query_len], layout.positions)
        return GraphOutputs(hidden, self.model.compute_logits(hidden))

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    def _copy_sequences(self, layout: BatchLayout, batch: int) -> None:
        """The per-sequence buffers of n real sequences, the rest as padding (no KV read or write)."""
        n = layout.num_seqs
        self.seq_lens[:n].copy_(layout.seq_lens)
        self.state_slots[:n].copy_(layout.state_slots)
        width = layout.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(layout.block_tables)
        if batch > n:
            self.seq_lens[n:batch].fill_(0)
            self.state_slots[n:batch].fill_(self.runner.padding_slot)

    def run(self, batch_inputs) -> Replayed:
        """The logits and hidden states of a pure decode step of n sequences (executor.model_runner.BatchInputs)."""
        input_ids, layout = batch_inputs.input_ids, batch_inputs.layout
        n = input_ids.shape[0]
        batch = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(layout.positions)
        self.slot_mapping[:n].copy_(layout.slot_mapping)
        if batch > n:
            self.slot_mapping[n:batch].fill_(-1)
        self._copy_sequences(layout, batch)
        self.graphs[batch].replay()
        return Replayed(self.outputs[batch], n, n)


class VerifyGraphs(DecodeGraphs):
    """Verify steps of up to 1 + num_speculative_tokens rows per sequence (module docstring)."""

    kind = "verify"

    def _forward(self, batch: int) -> GraphOutputs:
        """As a decode graph's, with the greedy verdict on every sequence's drafts."""
        out = super()._forward(batch)
        logits = out.logits[:, :self.runner.sampled_vocab_size or out.logits.shape[1]]
        verdict = verify_greedy_padded(logits, self.input_ids[:batch * self.query_len],
                                       self.real_query_lens[:batch], self.query_len)
        return out._replace(verdict=verdict)

    def warm_up_rejection_sampler(self) -> None:
        """Compile the rejection sampler's variants before the first request meets them: greedy
        rows read the LM head's logits as they are, sampled rows filtered fp32 ones, at the
        vocabulary the runner samples from."""
        logits = self.outputs[self.sizes[0]].logits[:self.query_len]
        logits = logits[:, :self.runner.sampled_vocab_size or logits.shape[1]].contiguous()
        drafts = [[0] * (self.query_len - 1)]
        for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0)):
            verify_drafts(logits, [SamplingRow(params, 0, [0], 1)], drafts)
        torch.cuda.synchronize(self.device)

    def can_run_step(self, batch_inputs, num_sampled_rows: int) -> bool:
        layout = batch_inputs.layout
        # Upper bounds of the lengths serve: a step planned over drafts in flight continues a
        # computed context whatever that step accepts.
        return (layout.num_seqs <= self.max_batch
                and fits_verify_graph(layout.query_lens_cpu, layout.seq_len_bounds, num_sampled_rows, self.query_len))

    def run(self, batch_inputs) -> Replayed:
        """The logits and hidden states of every row of a verify step, in its ragged order, and
        the greedy verdict per sequence. Its layout is built on the host (batch_inputs.host) and
        copied in whole: one upload of the rows' buffers, one of the sequences', the block tables.
        A step some of whose inputs only the device holds (executor/last_step.py) is gathered
        from the device tensors instead (`_copy_from_device`)."""
        layout, host = batch_inputs.layout, batch_inputs.host
        n, q = layout.num_seqs, self.query_len
        batch = next(s for s in self.sizes if s >= n)
        if host is None:
            return self._copy_from_device(batch_inputs, batch)
        row_buffers = self._staging(self.row_buffers)
        rows = row_buffers.numpy()
        rows[:] = np.array([[0], [0], [-1]])  # dummy rows: token 0, their sequence's last position, no KV write
        full = host.input_ids.shape[0] == n * q  # every sequence has q real rows: no dummy rows among them
        placed = None if full else verify_rows(layout.query_lens_cpu, layout.seq_lens_cpu, q)
        real = slice(0, n * q) if full else placed.padded_rows
        rows[0, real] = host.input_ids
        rows[1, :n * q] = host.positions if full else placed.positions
        rows[2, real] = host.slot_mapping
        self.row_buffers.copy_(row_buffers, non_blocking=True)
        self._copy_sequences_in(batch_inputs, layout.seq_lens_cpu)
        width = layout.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(layout.block_tables)
        self.graphs[batch].replay()
        if full:  # the step's rows are the graph's first n * q
            return Replayed(self.outputs[batch], n * q, n)
        return Replayed(self.outputs[batch], self._upload_index(placed.padded_rows), n)

    def _copy_sequences_in(self, batch_inputs, seq_lens) -> None:
        """The per-sequence buffers from the host, in one upload: lengths (`seq_lens`), real rows,
        state slots; padding sequences read no KV and own no state."""
        layout, n = batch_inputs.layout, batch_inputs.layout.num_seqs
        staged = self._staging(self.seq_buffers)
        seqs = staged.numpy()
        seqs[:] = np.array([[0], [1], [self.runner.padding_slot]])
        seqs[0, :n] = seq_lens
        seqs[1, :n] = layout.query_lens_cpu
        seqs[2, :n] = batch_inputs.state_slots_cpu
        self.seq_buffers.copy_(staged, non_blocking=True)

    def _upload_index(self, values: np.ndarray) -> torch.Tensor:
        index = self._staging(torch.from_numpy(values))
        index.numpy()[:] = values
        return index.to(self.device, non_blocking=True)

    def _copy_from_device(self, batch_inputs, batch: int) -> Replayed:
        """`run` for a step whose input ids, positions, slots and lengths are the device's (a
        step planned over a verify step in flight): graph row (i, t) takes sequence i's ragged row
        min(t, len_i - 1), a dummy row (t >= len_i) with no KV write."""
        layout = batch_inputs.layout
        n, q = layout.num_seqs, self.query_len
        lens = np.asarray(layout.query_lens_cpu, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        t = np.arange(q)
        source = (starts[:, None] + np.minimum(t[None, :], lens[:, None] - 1)).ravel()
        dummy = (t[None, :] >= lens[:, None]).ravel()
        rows = batch * q
        both = self._upload_index(np.concatenate([source, np.flatnonzero(dummy)]))
        source_d, dummy_d = both[:n * q], both[n * q:]
        torch.index_select(batch_inputs.input_ids, 0, source_d, out=self.input_ids[:n * q])
        torch.index_select(layout.positions, 0, source_d, out=self.positions[:n * q])
        torch.index_select(layout.slot_mapping, 0, source_d, out=self.slot_mapping[:n * q])
        if dummy.any():
            self.slot_mapping[dummy_d] = -1
        if rows > n * q:
            self.slot_mapping[n * q:rows].fill_(-1)  # padding sequences: no KV write
        self._copy_sequences_in(batch_inputs, 0)
        self.seq_lens[:n].copy_(layout.seq_lens)  # the lengths the device moved back
        width = layout.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(layout.block_tables)
        self.graphs[batch].replay()
        if not dummy.any():
            return Replayed(self.outputs[batch], n * q, n)
        return Replayed(self.outputs[batch], self._upload_index(np.flatnonzero(~dummy)), n)


class PrefillGraphs(CapturedGraphs):
    """Graphs of one fresh sequence's whole prompt, padded to `sizes` tokens (module docstring)."""

    kind = "prefill"
    size_name = "tokens"

    def __init__(self, runner, sizes: list[int], max_blocks_per_seq: int, max_model_len: int, min_tokens: int = 1):
        super().__init__(runner, sizes, max_model_len, query_len=1)
        self.min_tokens = min_tokens  # shorter prompts prefill eagerly (module docstring)
        device, rows = self.device, self.max_batch
        # Rows: input ids, positions, slots; the fourth holds the last real row's index at [3, 0].
        self.row_buffers = torch.zeros(4, rows, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, last = self.row_buffers.unbind(0)
        self.last_row = last[:1]
        self.block_tables = torch.zeros(1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.state_slots = torch.full((1,), runner.padding_slot, dtype=torch.int32, device=device)
        self.has_initial_state = torch.zeros(1, dtype=torch.int32, device=device)
        # Per bucket T: the sequence is T long and all of it is this step's rows.
        self.seq_lens = {t: torch.full((1,), t, dtype=torch.int32, device=device) for t in sizes}
        self.query_start_loc = {t: torch.tensor([0, t], dtype=torch.int32, device=device) for t in sizes}

    def _layout(self, tokens: int) -> BatchLayout:
        return BatchLayout(
            positions=self.positions[:tokens], query_start_loc=self.query_start_loc[tokens],
            seq_lens=self.seq_lens[tokens], block_tables=self.block_tables, slot_mapping=self.slot_mapping[:tokens],
            state_slots=self.state_slots, has_initial_state=self.has_initial_state, max_query_len=tokens,
            max_seq_len=tokens, query_lens_cpu=[tokens], seq_lens_cpu=[tokens], is_pure_decode=False)

    def _forward(self, tokens: int) -> GraphOutputs:
        """Every row's hidden states, and the logits of the last real row."""
        layout = self._layout(tokens)
        with set_forward_context(self.runner.forward_context(layout)):
            hidden = self.model(self.input_ids[:tokens], layout.positions)
        return GraphOutputs(hidden, self.model.compute_logits(hidden.index_select(0, self.last_row)))

    def can_run_step(self, batch_inputs) -> bool:
        """One sequence from its first token, its whole prompt in this step, within the largest
        bucket and of at least min_tokens."""
        layout = batch_inputs.layout
        return (batch_inputs.host is not None and layout.num_seqs == 1 and batch_inputs.logits_rows is None
                and self.min_tokens <= layout.query_lens_cpu[0] == layout.seq_lens_cpu[0] <= self.max_batch
                and len(batch_inputs.sampled_request_ids) == 1 and batch_inputs.multimodal is None)

    def run(self, batch_inputs) -> Replayed:
        layout, host = batch_inputs.layout, batch_inputs.host
        n = layout.query_lens_cpu[0]
        tokens = next(t for t in self.sizes if t >= n)
        staged = self._staging(self.row_buffers)
        rows = staged.numpy()
        rows[0] = 0  # padding rows: token 0, the positions after the prompt, no KV write
        rows[0, :n] = host.input_ids
        rows[1] = np.arange(rows.shape[1])
        rows[2] = -1
        rows[2, :n] = host.slot_mapping
        rows[3, 0] = n - 1
        self.row_buffers.copy_(staged, non_blocking=True)
        width = layout.block_tables.shape[1]  # entries past it are stale: only padding rows read them
        self.block_tables[:, :width].copy_(layout.block_tables)
        self.graphs[tokens].replay()
        return Replayed(self.outputs[tokens], n, 1, logits_sampled=True)


class VerifyGraphSet:
    """Verify graphs for every row count q = 2 .. 1 + k (one VerifyGraphs each, one memory pool):
    a step replays the smallest q that holds its longest sequence, so a step of fewer drafts than
    k does not pay for k (what lets the cost model choose a smaller k at larger batches)."""

    def __init__(self, runner, max_num_seqs: int, num_speculative_tokens: int, max_blocks_per_seq: int,
                 max_model_len: int, max_rows: int):
        self.by_rows = {1 + k: VerifyGraphs(runner, verify_capture_sizes(max_num_seqs, k, max_rows),
                                            max_blocks_per_seq, max_model_len, 1 + k)
                        for k in range(1, num_speculative_tokens + 1)}
        self.query_len = 1 + num_speculative_tokens  # the most rows a sequence may have
        self.max_rows = max_rows

    def capture(self, pool=None):
        for graphs in reversed(self.by_rows.values()):  # the largest rows first: the rest fit in its pool
            pool = graphs.capture(pool)
        self.by_rows[self.query_len].warm_up_rejection_sampler()
        return pool

    def release(self) -> None:
        for graphs in self.by_rows.values():
            graphs.release()

    @property
    def memory_bytes(self) -> int:
        return sum(graphs.memory_bytes for graphs in self.by_rows.values())

    def _pick(self, layout: BatchLayout) -> VerifyGraphs | None:
        rows = max(layout.query_lens_cpu)
        return next((g for q, g in self.by_rows.items() if q >= rows and layout.num_seqs <= g.max_batch), None)

    def can_run_step(self, batch_inputs, num_sampled_rows: int) -> bool:
        graphs = self._pick(batch_inputs.layout)
        return graphs is not None and graphs.can_run_step(batch_inputs, num_sampled_rows)

    def run(self, batch_inputs) -> Replayed:
        return self._pick(batch_inputs.layout).run(batch_inputs)
