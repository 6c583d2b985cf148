"""The model runner: the only place that builds tensors.

It keeps each running request's tokens, block table and state slot (sent whole once, then as
diffs), turns a SchedulerOutput into one BatchLayout (input ids, positions, slot mapping, block
tables, sequence lengths, state slots), runs the model under a ForwardContext whose metadata
each cache kind's backend builds from that layout, and samples where the logits are.

A step on the device, in order: block copies and state restores the plan asks for, the forward
pass, state checkpoints (`state_saves`), the sampler. A request with drafts (speculative
decoding) is computed over its last token and its drafts, and the rejection sampler verifies them
(executor/rejection_sampler.py); its runner tokens take the drafts only for that step's inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from metrale.config.cache_config import CacheConfig
from metrale.config.model_config import ModelConfig
from metrale.executor.cache_layout import CacheLayout
from metrale.executor.cache_tensors import CacheTensors
from metrale.executor.drafters.base import DraftInputs, DraftOutput, RunnerDrafter
from metrale.executor.last_step import LastStep
from metrale.executor.step_indices import speculative_indices
from metrale.executor.step_output import PendingOutput, VerifiedDrafts
from metrale.executor.multimodal_step import mrope_positions, multimodal_batch
from metrale.executor.rejection_sampler import verify_drafts
from metrale.executor.sampler import SampledTokens, SamplingRow, sample_tokens
from metrale.kernels import kernel_path
from metrale.kernels.fp8_linear import rows_on_one_path
from metrale.layers.cache_backend import CacheBackend, get_backend
from metrale.layers.cache_spec import cached_layers
from metrale.layers.forward_context import BatchLayout, DeviceLengths, DraftStates, ForwardContext, set_forward_context
from metrale.messages.sampling_params import SamplingParams
# A placeholder's value is on the device; the next step's input takes it there.
from metrale.messages.scheduler_output import PLACEHOLDER, NewRequestData, SchedulerOutput
from metrale.multimodal.encoder_cache import EncoderCache
from metrale.structured.grammars import GrammarCache
from metrale.structured.matchers import GrammarMatchers

if TYPE_CHECKING:
    from metrale.executor.cuda_graphs import Replayed

logger = logging.getLogger(__name__)


@dataclass
class RunnerRequest:
    """What the runner keeps of a request between steps. `token_ids` grows by the sampled tokens
    (placeholders until they are read), `block_ids` by each step's new blocks."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    state_slot: int
    media: list = None  # MediaItem per image / video of the prompt
    mrope_positions: np.ndarray | None = None  # int64 [3, prompt tokens]; None: the token indices
    mrope_delta: int = 0
    # The plan's CachedRequestData.num_unverified_drafts: num_computed_tokens counts that many drafts
    # of the step in flight, which the device moves this step's rows back over (last_step.py).
    num_unverified_drafts: int = 0

    def resolve_placeholder(self, tokens: list[int]) -> None:
        """The oldest step in flight's tokens (a verify step's accepted drafts, then its sampled
        token), in place of its placeholder: the first of the trailing ones."""
        t = self.token_ids
        first = len(t)
        while first > self.num_prompt_tokens and t[first - 1] == PLACEHOLDER:
            first -= 1
        if first < len(t):
            t[first:first + 1] = tokens

    @classmethod
    def of(cls, new: NewRequestData) -> "RunnerRequest":
        positions = np.asarray(new.mrope_positions, dtype=np.int64) if new.mrope_positions is not None else None
        return cls(new.token_ids, new.num_prompt_tokens, new.sampling_params, new.seed, new.block_ids,
                   new.num_computed_tokens, new.state_slot, list(new.media), positions, new.mrope_delta)


@dataclass
class HostRows:
    """A step's per-row and per-sequence inputs as the host built them (what a verify graph's
    layout is filled from, executor/cuda_graphs.py)."""

    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    layout: BatchLayout
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    sampled_request_ids: list[str]
    # Speculative decoding: the rows of logits_indices each sampled request owns (1 + k for one
    # with drafts, 1 otherwise), in sampled_request_ids' order; None without drafts in the batch.
    logits_rows: list[range] | None = None
    # A runner-side drafter's view (executor/drafters/base.py), host side: each sequence's KV room
    # in tokens. None without a drafter.
    capacity: list[int] | None = None
    sampled_seq_index: list[int] | None = None  # each sampled request's sequence in the batch
    # The host's copy of the inputs; None where some are the device's alone (executor/last_step.py).
    host: HostRows | None = None
    state_slots_cpu: np.ndarray | None = None  # int64 [num_seqs], on the host
    # Speculative steps and runner-side drafters: executor/step_indices.py's arrays, on the device.
    index: dict[str, torch.Tensor] = field(default_factory=dict)
    request_ids: list[str] | None = None  # every sequence's request, in the layout's order
    # int64 [sampled requests] on the device: outputs a sampled request's output index lacks (the
    # drafts its verify step in flight accepted, where it was planned over it and samples at
    # random: its streams are keyed by that index); None where no such request samples.
    index_shift: torch.Tensor | None = None
    # `uses_mrope` models: int64 [3, T] positions (executor/multimodal_step.py); and the step's
    # placeholder rows with their encoder outputs, None without any.
    mrope_positions: torch.Tensor | None = None
    multimodal: object = None  # layers.vision.batch.MultiModalBatch


@dataclass
class EagerOutputs:
    """An eager forward's results, read as a graph replay's (executor.cuda_graphs.Replayed)."""

    logits: torch.Tensor | None  # [sampled rows, vocab]; None when no row is sampled
    hidden: torch.Tensor  # [num_tokens, hidden]
    verdict: None = None  # only a verify graph computes the greedy verdict


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, device: torch.device,
                 cache_config: CacheConfig, backend: str = "auto", forward: str | None = None,
                 drafter: RunnerDrafter | None = None):
        """`forward`: graphs, eager or reference (--forward; default: eager on CUDA, reference on
        the CPU); reference runs every layer's PyTorch path (kernels.kernel_path). `drafter`: a
        runner-side drafter of speculative decoding (MTP, DFlash); its caches join the model's."""
        forward = forward or ("eager" if device.type == "cuda" else "reference")
        self.model = model
        self.forward_mode = forward
        self.reference = forward == "reference"
        # The kernels' path for this runner's work (kernels.kernel_path): the PyTorch reference,
        # the Triton kernels on CPU tensors (eager on a CPU: the interpreter), or the default rule.
        self.kernel_path = "reference" if self.reference else "kernels" if device.type == "cpu" else None
        self.model_config = model_config
        self.device = device
        self.block_size = cache_config.block_size
        self.drafter = drafter
        self._draft_probs: dict[str, torch.Tensor] = {}  # request -> [k, vocab]: its drafts' q
        drafter_layers = drafter.cached_layers() if drafter is not None else []
        self.layers = cached_layers(model) + drafter_layers
        self.layout = CacheLayout.of(model, cache_config, drafter_layers)
        if drafter is not None and drafter.hidden_layers:
            self.model.model.output_layers = tuple(drafter.hidden_layers)  # DecoderModel keeps their outputs
        # The tokenizer's size where the checkpoint pads its vocabulary past it: padded ids are never sampled.
        self.sampled_vocab_size: int | None = None
        self.kernel_report = None  # the startup kernel audit (executor.kernel_audit.KernelReport)
        # One backend per kind of cache the model keeps (attention, gdn, ...).
        self.backends: dict[str, CacheBackend] = {kind: get_backend(kind, backend, device)
                                                  for kind in self.layout.kinds}
        self.requests: dict[str, RunnerRequest] = {}
        self.caches: CacheTensors | None = None
        self.max_drafts = 0  # speculative decoding's k where verify steps keep per-draft state (allocate_caches)
        self.draft_rows = (0, 0)  # (first scratch row, sequences it holds rows for)
        self._pin = device.type == "cuda"
        self.graphs = None  # DecodeGraphs, once captured
        self.verify_graphs = None  # VerifyGraphSet, once captured (speculative decoding)
        self.prefill_graphs = None  # PrefillGraphs, once captured
        # What the last launched step sampled and drafted, on the device: the next step's inputs
        # where it is planned before that step is read (asynchronous scheduling).
        self.last_step = LastStep()
        # Structured outputs: the compiled grammars and a matcher per constrained request
        # (attach_grammars; absent without a tokenizer).
        self.grammars: GrammarCache | None = None
        self.matchers: GrammarMatchers | None = None
        # Vision-language models: the encoder outputs by content hash (multimodal/encoder_cache.py),
        # in encoder rows; the engine sets its capacity from the encoder budget.
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.encoder_cache = EncoderCache(capacity_rows=8192)

    def attach_grammars(self, grammars: GrammarCache) -> None:
        self.grammars = grammars
        self.matchers = GrammarMatchers(grammars, pin_memory=self._pin)

    @property
    def backend_names(self) -> str:
        return ", ".join(f"{kind} {backend.name}" for kind, backend in self.backends.items()) or "none"

    @property
    def supports_cuda_graphs(self) -> bool:
        # M-RoPE models run eagerly: the decode graphs' positions buffer is [T], not [3, T].
        return self.device.type == "cuda" and not self.uses_mrope and all(b.supports_cuda_graphs for b in self.backends.values())

    @property
    def supports_verify_graphs(self) -> bool:
        """Every backend reads a verify graph's layout (BatchLayout.uniform_query_len)."""
        return self.supports_cuda_graphs and all(getattr(b, "supports_verify_graphs", False)
                                                 for b in self.backends.values())

    @property
    def supports_prefill_graphs(self) -> bool:
        """Prefill graphs (executor/cuda_graphs.PrefillGraphs): every backend reads their padded
        layout, and every layer but attention is row-wise on the padding rows (no MoE routing),
        with no runner-side drafter reading the step."""
        from metrale.layers.moe.layer import FusedMoE

        return (self.supports_cuda_graphs and (self.drafter is None or not self.drafter.reads_hidden_states)
                and all(getattr(b, "supports_prefill_graphs", False) for b in self.backends.values())
                and not any(isinstance(m, FusedMoE) for m in self.model.modules()))

    @property
    def prefill_graph_min_tokens(self) -> int:
        """The shortest prompt a prefill graph takes: FP8 linear layers compute a prompt padded to
        the graph's rows as they compute it unpadded only from kernels.fp8_linear.rows_on_one_path
        rows on."""
        quantization = self.model_config.quantization
        return 1 if quantization is None else rows_on_one_path(quantization.activation_group)

    def release_cuda_graphs(self) -> None:
        """Back to eager decode steps (before shutting a multi-rank engine's groups down)."""
        for graphs in (self.graphs, self.verify_graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.verify_graphs = self.prefill_graphs = None

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, step_token_budget: int,
                            num_speculative_tokens: int = 0, max_prefill_tokens: int = 0) -> None:
        """Decode graphs, verify graphs of 1 + num_speculative_tokens rows per sequence when
        speculating and every backend supports them (within `verify_row_limit` rows of the step's
        token budget), and prefill graphs of up to max_prefill_tokens tokens where the model allows
        them (executor/cuda_graphs.py)."""
        from metrale.executor.cuda_graphs import (DecodeGraphs, PrefillGraphs, VerifyGraphSet, capture_sizes,
                                                  prefill_capture_sizes, verify_row_limit)

        if not self.supports_cuda_graphs:
            return
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self, capture_sizes(max_num_seqs), max_blocks, max_model_len)
        pool = self.graphs.capture()
        if num_speculative_tokens and not self.supports_verify_graphs:
            logger.info("verify steps run eagerly: the %s backends have no verify graphs", self.backend_names)
        elif num_speculative_tokens:
            self.verify_graphs = VerifyGraphSet(self, max_num_seqs, num_speculative_tokens, max_blocks, max_model_len,
                                                verify_row_limit(max_num_seqs, step_token_budget))
            pool = self.verify_graphs.capture(pool)
        sizes = prefill_capture_sizes(min(max_prefill_tokens, max_model_len))
        if sizes and self.supports_prefill_graphs:
            self.prefill_graphs = PrefillGraphs(self, sizes, max_blocks, max_model_len, self.prefill_graph_min_tokens)
            try:
                self.prefill_graphs.capture(pool)
            except torch.OutOfMemoryError:  # the graphs' activations come on top of the memory plan
                self.prefill_graphs.release()
                self.prefill_graphs = None
                torch.cuda.empty_cache()
                logger.warning("no prefill CUDA graphs: out of device memory while capturing them; "
                               "prefills run eagerly (lower --gpu-memory-utilization to leave room)")

    def replay_graph(self, batch: BatchInputs) -> Replayed | None:
        """The step's outputs from a captured graph (the logits of its sampled rows, the hidden
        states of all its rows), or None when no graph fits it: a fresh sequence's whole prompt
        (a prefill graph), a pure decode step (one row per sequence) or a verify step (decodes
        and drafts only, at most 1 + k rows per sequence; every row sampled). Every row of such a
        step is sampled, so both are in the batch's row order."""
        num_tokens, layout = batch.input_ids.shape[0], batch.layout
        if self.prefill_graphs is not None and self.prefill_graphs.can_run_step(batch):
            return self.prefill_graphs.run(batch)
        if (self.graphs is not None and layout.is_pure_decode
                and len(batch.sampled_request_ids) == num_tokens and self.graphs.can_run(num_tokens)):
            return self.graphs.run(batch)
        if (self.verify_graphs is not None and batch.logits_rows is not None
                and self.verify_graphs.can_run_step(batch, batch.logits_indices.shape[0])):
            return self.verify_graphs.run(batch)
        return None

    # -- the caches ----------------------------------------------------------------------------

    def allocate_caches(self, num_blocks: int, num_state_slots: int, max_drafts: int = 0,
                        max_num_seqs: int = 0) -> None:
        """The paged caches at `num_blocks` blocks, and `num_state_slots` request slots of state
        (plus the padding slot) when the model keeps any. `max_drafts` (speculative decoding's k)
        adds max_num_seqs x k scratch rows after the request slots: a verify step's sequence at
        batch index i keeps its state after draft j in row first + i * k + j (draft_states.py)."""
        self.release_caches()
        has_state = self.layout.has_state
        self.max_drafts = max_drafts if has_state else 0
        self.draft_rows = (num_state_slots, max_num_seqs if self.max_drafts else 0)  # (first row, sequences)
        slots = num_state_slots + self.draft_rows[1] * self.max_drafts + 1 if has_state else 0
        self.caches = CacheTensors(self.layers, self.layout, num_blocks, slots, self.device)
        if self.drafter is not None:
            self.drafter.allocate(max_num_seqs or num_state_slots, self.device)

    def release_caches(self) -> None:
        if self.caches is not None:
            self.caches.release()
            self.caches = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @property
    def padding_slot(self) -> int:
        return self.caches.padding_slot if self.caches is not None and self.layout.has_state else 0

    def forward_context(self, layout: BatchLayout) -> ForwardContext:
        return ForwardContext(layout, {kind: b.build_metadata(layout) for kind, b in self.backends.items()},
                              self.backends)

    # -- one step ------------------------------------------------------------------------------

    def apply_plan(self, plan: SchedulerOutput) -> None:
        for request_id in plan.finished_request_ids:
            self._drop(request_id)
        for new in plan.new_requests:
            self.requests[new.request_id] = RunnerRequest.of(new)  # the scheduler built its lists for this plan alone
            if self.drafter is not None:
                self.drafter.admit(new.request_id, new.token_ids)
            if new.sampling_params.structured_outputs is not None:
                if self.matchers is None:
                    raise RuntimeError("a request with structured outputs reached a runner without grammars")
                self.matchers.add(new.request_id, new.sampling_params)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.num_unverified_drafts = cached.num_unverified_drafts
        for request_id, drafts in plan.draft_token_ids.items():
            self.requests[request_id].token_ids.extend(drafts)  # this step's inputs; taken back once sampled
        if len(self.encoder_cache):
            self.encoder_cache.evict({item.content_hash for st in self.requests.values() for item in (st.media or ())
                                      if st.num_computed_tokens < item.offset + item.length})

    def _drop(self, request_id: str) -> None:
        """Forget a request: finished, aborted or preempted (a resumed one starts afresh)."""
        self.requests.pop(request_id, None)
        self._draft_probs.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(request_id)
        if self.matchers is not None:
            self.matchers.remove(request_id)

    def drop_requests(self) -> None:
        """Forget every request (after startup's profiling, calibration and warm-up steps)."""
        for request_id in list(self.requests):
            self._drop(request_id)

    def _upload(self, arrays: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A step's index arrays of one dtype in ONE host->device copy: packed into one buffer
        (pinned on CUDA: each pinned staging buffer and copy costs tens of microseconds of host
        time), copied without blocking, and handed back as views of the device copy."""
        # Each view starts 16-byte aligned: Triton compiles a kernel variant per pointer alignment,
        # so unaligned offsets that change from step to step would recompile the kernels.
        align = max(1, 16 // dtype.itemsize)
        offsets, total = [], 0
        for array in arrays.values():
            offsets.append(total)
            total += -(-array.size // align) * align
        host = torch.empty(total, dtype=dtype, pin_memory=self._pin)
        packed = host.numpy()
        for offset, array in zip(offsets, arrays.values()):
            packed[offset:offset + array.size] = array.ravel()  # numpy casts to the buffer's dtype
        device = host.to(self.device, non_blocking=True)
        return {name: device[offset:offset + array.size].view(array.shape)
                for offset, (name, array) in zip(offsets, arrays.items())}

    def prepare_inputs(self, plan: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        scheduled = [(rid, self.requests[rid], n) for rid, n in plan.num_scheduled_tokens.items()]
        num_seqs = len(scheduled)
        query_lens = np.fromiter((n for _, _, n in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((st.num_computed_tokens for _, st, _ in scheduled), dtype=np.int64, count=num_seqs)
        # Planned over a verify step in flight: starts (and so positions, slots, lengths) count its
        # drafts as accepted until LastStep.fill moves them back on the device.
        unverified = np.fromiter((st.num_unverified_drafts for _, st, _ in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = starts + query_lens
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        width = max(len(st.block_ids) for _, st, _ in scheduled)
        tables = np.zeros((num_seqs, width), dtype=np.int32)
        for i, (_, st, _) in enumerate(scheduled):
            tables[i, :len(st.block_ids)] = st.block_ids
        input_ids = self._input_ids(plan, scheduled, query_lens)
        if int(query_lens.max()) == 1:  # pure decode: one token each
            positions = starts
            seq_index = np.arange(num_seqs)
        else:
            seq_index = np.repeat(np.arange(num_seqs), query_lens)
            positions = starts[seq_index] + (np.arange(len(input_ids)) - query_start[:-1][seq_index])
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        # A sequence samples when the step reaches its last token (always, planned over drafts).
        sampled_rows = [i for i, (_, st, _) in enumerate(scheduled)
                        if unverified[i] or seq_lens[i] == len(st.token_ids)]
        logits_indices = query_start[1:][sampled_rows] - 1
        logits_rows = None
        num_drafts = (np.fromiter((len(plan.draft_token_ids.get(rid, ())) for rid, _, _ in scheduled),
                                  dtype=np.int64, count=num_seqs) if plan.draft_token_ids
                      else np.zeros(num_seqs, dtype=np.int64))
        if plan.draft_token_ids:  # a request with k drafts samples its last 1 + k positions
            counts = (1 + num_drafts[sampled_rows]).tolist()
            logits_indices = np.concatenate([np.arange(end - n + 1, end + 1) for end, n in zip(logits_indices, counts)])
            bounds = np.cumsum([0] + counts).tolist()
            logits_rows = [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        sources = self.last_step.sources([rid for rid, _, _ in scheduled], seq_index, query_start, query_lens,
                                         num_drafts, unverified, input_ids)
        from_device = bool(sources)  # some inputs are only on the device: the host's copy is not the step's
        chunk_next_ids = capacity = None
        if self.drafter is not None:
            chunk_next_ids = np.fromiter(
                (st.token_ids[end] if not u and end < len(st.token_ids) else PLACEHOLDER
                 for (_, st, _), end, u in zip(scheduled, seq_lens.tolist(), unverified)),
                dtype=np.int64, count=num_seqs)
            capacity = np.fromiter((len(st.block_ids) * bs for _, st, _ in scheduled), dtype=np.int64, count=num_seqs)
        indices = {}
        if plan.draft_token_ids or self.drafter is not None:
            indices = speculative_indices(np.asarray(sampled_rows, dtype=np.int64), logits_indices, logits_rows,
                                          num_drafts, len(input_ids), query_start, chunk_next_ids, capacity)
        wide = {"input_ids": input_ids, "positions": positions, "slots": slots, "logits_indices": logits_indices,
                **sources, **indices, **self._shift_sources(scheduled, sampled_rows, unverified)}
        state_slots = np.fromiter((st.state_slot for _, st, _ in scheduled), dtype=np.int64, count=num_seqs)
        narrow = {"tables": tables, "seq_lens": seq_lens, "query_start": query_start,
                  "state_slots": state_slots, "has_state": starts > 0}
        kept_states = bool(plan.draft_token_ids) and self.layout.has_state  # where the states after each draft go
        if kept_states:
            wide["drafted"] = np.flatnonzero(num_drafts)
            narrow["num_drafts"], narrow["draft_rows"] = num_drafts, self._draft_rows(num_drafts)
        dev = self._upload(wide, torch.int64)
        dev.update(self._upload(narrow, torch.int32))
        if from_device:
            self.last_step.fill(dev, bs)
        index_shift = None
        if "shift_sources" in dev:
            accepted = self.last_step.accepted
            index_shift = torch.cat([accepted, accepted.new_zeros(1)])[dev["shift_sources"]]
        layout = BatchLayout(
            positions=dev["positions"], query_start_loc=dev["query_start"], seq_lens=dev["seq_lens"],
            block_tables=dev["tables"], slot_mapping=dev["slots"], state_slots=dev["state_slots"],
            has_initial_state=dev["has_state"], max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()), query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=DeviceLengths(dev["seq_lens"]) if unverified.any() else seq_lens.tolist(),
            is_pure_decode=bool(query_lens.max() == 1 and starts.min() > 0), seq_len_bounds_cpu=seq_lens.tolist())
        if kept_states:
            layout.drafts = DraftStates(dev["num_drafts"], dev["draft_rows"], dev["drafted"], self.max_drafts,
                                        bool(starts.min() > 0 and (query_lens == 1 + num_drafts).all()))
        batch = BatchInputs(dev["input_ids"], layout, dev["logits_indices"], [scheduled[i][0] for i in sampled_rows],
                            logits_rows, host=None if from_device else HostRows(input_ids, positions, slots),
                            state_slots_cpu=state_slots,
                            index={name: dev[name] for name in indices}, request_ids=[rid for rid, _, _ in scheduled],
                            index_shift=index_shift)
        if self.uses_mrope:
            batch.mrope_positions = torch.from_numpy(mrope_positions(scheduled, positions, seq_index)).to(self.device)
            batch.multimodal = multimodal_batch(self.model, self.encoder_cache, scheduled, starts, query_lens,
                                                self.device, self.model_config.dtype)
        if self.drafter is not None:
            batch.capacity = capacity.tolist()
            batch.sampled_seq_index = list(sampled_rows)
        return batch

    def _shift_sources(self, scheduled: list, sampled_rows: list[int], unverified: np.ndarray) -> dict[str, np.ndarray]:
        """Where sampled requests that draw at random were planned over their verify step in
        flight: per sampled request, its row among the last step's accepted counts, or past them
        (no shift); {} where none was."""
        if not unverified.any() or not any(unverified[i] and not scheduled[i][1].sampling_params.greedy
                                           for i in sampled_rows):
            return {}
        rows, past = self.last_step.rows, self.last_step.accepted.shape[0]
        return {"shift_sources": np.fromiter((rows[scheduled[i][0]] if unverified[i] else past for i in sampled_rows),
                                             dtype=np.int64, count=len(sampled_rows))}

    @staticmethod
    def _input_ids(plan: SchedulerOutput, scheduled: list, query_lens: np.ndarray) -> np.ndarray:
        """The step's input ids, PLACEHOLDER where only the device holds the token: a token the step
        in flight sampled, a draft its drafter proposed. A request planned over its verify step in
        flight starts at the token that step samples, then its drafts."""
        if int(query_lens.max()) == 1:
            return np.fromiter((PLACEHOLDER if st.num_unverified_drafts else st.token_ids[st.num_computed_tokens]
                                for _, st, _ in scheduled), dtype=np.int64, count=len(scheduled))
        rows = [[PLACEHOLDER] + plan.draft_token_ids.get(rid, []) if st.num_unverified_drafts
                else st.token_ids[st.num_computed_tokens:st.num_computed_tokens + n] for rid, st, n in scheduled]
        return np.concatenate(rows).astype(np.int64, copy=False)

    def _draft_rows(self, num_drafts: np.ndarray) -> np.ndarray:
        """[num_seqs, k] scratch rows of a verify step: batch index i's row for draft j, or the
        padding slot where j >= its drafts (never written as a kept state, never read)."""
        first, capacity = self.draft_rows
        k = self.max_drafts
        if not k or len(num_drafts) > capacity or int(num_drafts.max()) > k:
            raise RuntimeError(f"a verify step of {len(num_drafts)} sequences with up to {int(num_drafts.max())} "
                               f"drafts, but the state cache has scratch rows for {capacity} x {k}: "
                               "allocate_caches(max_drafts=k, max_num_seqs=...) sizes them")
        rows = first + np.arange(len(num_drafts))[:, None] * k + np.arange(k)[None, :]
        return np.where(np.arange(k)[None, :] < num_drafts[:, None], rows, self.padding_slot)

    def forward(self, batch: BatchInputs) -> torch.Tensor:
        """The hidden states of every token of the batch."""
        with set_forward_context(self.forward_context(batch.layout)), self.kernel_context():
            if not self.uses_mrope:
                return self.model(batch.input_ids, batch.layout.positions)
            positions = batch.mrope_positions
            if positions is None:  # a batch built elsewhere (warm-up, profiling): text rows
                positions = batch.layout.positions.unsqueeze(0).expand(3, -1)
            return self.model(batch.input_ids, positions, multimodal=batch.multimodal)

    @torch.inference_mode()
    def execute_async(self, plan: SchedulerOutput) -> PendingOutput:
        """Launch one step. Each sampled request gets a placeholder token until `result()`."""
        with self.kernel_context():
            return self._execute_async(plan)

    def kernel_context(self):
        """The kernels' path for work done for this runner (every forward and sampling call)."""
        return kernel_path(self.kernel_path)

    def _execute_async(self, plan: SchedulerOutput) -> PendingOutput:
        self.apply_plan(plan)
        self.caches.copy_blocks(plan.block_copies)
        self.caches.copy_slots(plan.state_restores)
        if plan.is_empty:
            return PendingOutput(self, [], None)
        batch = self.prepare_inputs(plan)
        # The graphs give the logits and the final hidden states; a drafter that reads inner
        # layers' outputs too (DFlash: `hidden_layers`) needs the eager forward.
        outputs = self.replay_graph(batch) if self.drafter is None or not self.drafter.hidden_layers else None
        if outputs is None:
            outputs = self._forward_eagerly(batch)
        self.caches.copy_slots(plan.state_saves)  # after the forward pass that computed the states
        if not batch.sampled_request_ids:
            if self.drafter is not None:  # a prefill chunk: the drafter fills its caches over it
                self._draft(batch, outputs.hidden, None, None)
            return PendingOutput(self, [], None)
        states = [self.requests[request_id] for request_id in batch.sampled_request_ids]
        verified = None
        if plan.draft_token_ids and outputs.verdict is not None and self._verdict_settles(states):
            sampled, verified = self._take_verdict(outputs.verdict, batch, states, plan.draft_token_ids)
        else:
            logits = outputs.logits
            if self.sampled_vocab_size is not None:
                logits = logits[:, :self.sampled_vocab_size].contiguous()
            if plan.draft_token_ids:
                sampled, verified = self._sample_and_verify(logits, batch, states, plan.draft_token_ids)
            else:
                sampled = sample_tokens(logits, [SamplingRow(st.sampling_params, st.seed, st.token_ids,
                                                             st.num_prompt_tokens) for st in states],
                                        self._token_bitmask(batch.sampled_request_ids, states), batch.index_shift)
        for state in states:
            state.token_ids.append(PLACEHOLDER)
        accepted = self._accepted_per_row(batch, verified)
        self.last_step.record(batch.sampled_request_ids, sampled.tokens, accepted)
        drafts = None
        if self.drafter is not None:
            drafts = self._draft(batch, outputs.hidden, sampled, accepted)
            self.last_step.record_drafts(drafts.token_ids)
        return PendingOutput(self, batch.sampled_request_ids, sampled, verified, drafts)

    def _accepted_per_row(self, batch: BatchInputs, verified: "VerifiedDrafts | None") -> torch.Tensor | None:
        """int64 [sampled requests]: the drafts each had accepted (0 where none were verified);
        None in a step that verifies nothing."""
        if verified is None or not verified.drafts:
            return None
        if len(verified.drafts) == len(batch.sampled_request_ids):  # all drafted: the sampler's order is the batch's
            return verified.num_accepted
        accepted = torch.zeros(len(batch.sampled_request_ids), dtype=torch.int64, device=self.device)
        accepted[batch.index["spec_positions"]] = verified.num_accepted
        return accepted

    def _forward_eagerly(self, batch: BatchInputs) -> EagerOutputs:
        hidden = self.forward(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices]) if batch.sampled_request_ids else None
        return EagerOutputs(logits, hidden)

    def _draft(self, batch: BatchInputs, hidden: torch.Tensor, sampled: SampledTokens | None,
               accepted: torch.Tensor | None) -> DraftOutput:
        """The runner-side drafter over this step (executor/drafters/base.py): its caches filled
        over the step's rows, the next step's drafts of every sampled request. No host sync."""
        ids, layout, index = batch.sampled_request_ids, batch.layout, batch.index
        # The token after each row: the next input within the sequence, then what ends the chunk.
        next_ids = torch.roll(batch.input_ids, -1)
        if index["known_rows"].numel():
            next_ids[index["known_rows"]] = index["known_next"]
        num_accepted = accepted if accepted is not None else \
            torch.zeros(len(ids), dtype=torch.int64, device=self.device)
        last_rows = index["first_rows"] + num_accepted
        tokens = sampled.tokens if sampled is not None else torch.empty(0, dtype=torch.int64, device=self.device)
        next_ids[last_rows] = tokens
        layer_hidden = getattr(self.model.model, "layer_outputs", {}) if self.drafter.hidden_layers else {}
        inputs = DraftInputs(layout, batch.input_ids, hidden, layer_hidden, next_ids, ids,
                             batch.sampled_seq_index, last_rows, num_accepted, tokens, batch.capacity,
                             self.forward_context, self.sampled_vocab_size, index["sampled_seqs"],
                             index["sampled_capacity"], batch.request_ids)
        out = self.drafter.propose(inputs)
        if out.probs is not None:  # kept until the request's next verify step reads them
            self._draft_probs.update(zip(ids, out.probs))
        return out

    def _draft_q(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """The distributions a runner-side drafter drew the request's drafts from (None: point
        masses). The scheduler verifies a prefix of the drafts the last step proposed."""
        q = self._draft_probs.get(request_id)
        return q[:num_drafts] if q is not None else None

    def _verdict_settles(self, states: list[RunnerRequest]) -> bool:
        """Whether a verify graph's greedy verdict is every row's token: each is greedy with
        nothing that changes its logits, and none asks for logprobs or follows a grammar."""
        return all(st.sampling_params.greedy and not st.sampling_params.changes_logits
                   and st.sampling_params.logprobs is None and st.sampling_params.structured_outputs is None
                   for st in states)

    def _take_verdict(self, verdict: torch.Tensor, batch: BatchInputs, states: list[RunnerRequest],
                      drafts: dict[str, list[int]]) -> tuple[SampledTokens, VerifiedDrafts]:
        """_sample_and_verify's result from a verify graph's verdict ([2, num_seqs]: the token, the
        drafts accepted; a request without drafts accepts none, so its token is plain greedy's)."""
        ids = batch.sampled_request_ids
        spec = [i for i, rid in enumerate(ids) if rid in drafts]
        num_accepted = verdict[1] if len(spec) == len(ids) else verdict[1][batch.index["spec_positions"]]
        rows = self._rows_without_drafts(ids, states, drafts)
        return self._verified(verdict[0], num_accepted, batch, rows, spec, drafts,
                              device_drafts=self._device_drafts(batch, spec, drafts))

    def _sample_and_verify(self, logits: torch.Tensor, batch: BatchInputs, states: list[RunnerRequest],
                           drafts: dict[str, list[int]]) -> tuple[SampledTokens, VerifiedDrafts]:
        """A batch with drafts: plain rows through the sampler, drafted ones through the rejection
        sampler; one token per request, in batch order."""
        ids = batch.sampled_request_ids
        plain = [i for i, rid in enumerate(ids) if rid not in drafts]
        spec = [i for i, rid in enumerate(ids) if rid in drafts]
        rows = self._rows_without_drafts(ids, states, drafts)
        plain_sampled = None
        if plain:
            tokens = torch.empty(len(ids), dtype=torch.int64, device=logits.device)
            plain_logits = logits[batch.index["plain_logit_rows"]]
            plain_sampled = sample_tokens(plain_logits, [rows[i] for i in plain],
                                          self._token_bitmask([ids[i] for i in plain], [states[i] for i in plain]),
                                          None if batch.index_shift is None
                                          else batch.index_shift[batch.index["plain_positions"]])
            tokens[batch.index["plain_positions"]] = plain_sampled.tokens
            spec_logits = logits[batch.index["spec_logit_rows"]]
        else:  # every request drafted (batch 1's verify step): the logits rows are spec's, in order
            spec_logits = logits
        draft_raw = self._draft_raw_logprobs(spec_logits, spec, rows, [len(drafts[ids[i]]) for i in spec])
        # Planned over the step in flight (scheduler.plans_over_drafts): drafts and output
        # indices the device holds, for requests whose logits nothing edits.
        device_drafts = self._device_drafts(batch, spec, drafts)
        shift = batch.index_shift
        num_accepted, spec_tokens = verify_drafts(
            spec_logits, [rows[i] for i in spec], [drafts[ids[i]] for i in spec],
            [self._draft_q(ids[i], len(drafts[ids[i]])) for i in spec], device_drafts,
            None if shift is None else shift if not plain else shift[batch.index["spec_positions"]],
            self._token_bitmask([ids[i] for i in spec], [states[i] for i in spec], [drafts[ids[i]] for i in spec]))
        if plain:
            tokens[batch.index["spec_positions"]] = spec_tokens
        else:
            tokens = spec_tokens
        sampled, verified = self._verified(tokens, num_accepted, batch, rows, spec, drafts, plain_sampled, plain,
                                           device_drafts)
        sampled.draft_raw_logprobs = draft_raw
        return sampled, verified

    @staticmethod
    def _draft_raw_logprobs(spec_logits: torch.Tensor, spec: list[int], rows: list[SamplingRow],
                            num_drafts: list[int]) -> dict[int, torch.Tensor]:
        """Batch row -> the raw logprobs of its 1 + drafts positions, for the drafted rows that ask
        for logprobs; taken before the rejection sampler reads (and may change) the logits."""
        out, start = {}, 0
        for i, n in zip(spec, num_drafts):
            if rows[i].params.logprobs is not None:
                out[i] = spec_logits[start:start + n + 1].float().log_softmax(dim=-1)
            start += n + 1
        return out

    @staticmethod
    def _rows_without_drafts(ids: list[str], states: list[RunnerRequest],
                             drafts: dict[str, list[int]]) -> list[SamplingRow]:
        """The sampling rows of a verify step's requests, whose runner tokens lose the step's
        drafts again (the result puts back the accepted ones)."""
        for rid, state in zip(ids, states):
            if drafts.get(rid):
                del state.token_ids[-len(drafts[rid]):]
        return [SamplingRow(st.sampling_params, st.seed, st.token_ids, st.num_prompt_tokens) for st in states]

    def _verified(self, tokens: torch.Tensor, num_accepted: torch.Tensor, batch: BatchInputs,
                  rows: list[SamplingRow], spec: list[int], drafts: dict[str, list[int]],
                  plain_sampled: SampledTokens | None = None, plain: list[int] = (),
                  device_drafts: torch.Tensor | None = None) -> tuple[SampledTokens, VerifiedDrafts]:
        """A verify step's result: its tokens (one per request, batch order) and the drafted
        requests' accepted counts (spec's order)."""
        ids = batch.sampled_request_ids
        kept = batch.layout.drafts
        if kept is not None:  # the linear-attention state of the last accepted position (drafted: spec's order)
            self.caches.keep_accepted_states(batch.layout.state_slots[kept.drafted], kept.state_rows[kept.drafted],
                                             kept.num_drafts[kept.drafted], num_accepted)
        # Logprobs of plain rows; drafted rows' come from _draft_raw_logprobs.
        want = [plain[i] for i in plain_sampled.want_logprobs] if plain_sampled is not None else []
        sampled = SampledTokens(tokens, rows, want, plain_sampled.raw_logprobs if plain_sampled is not None else None)
        return sampled, VerifiedDrafts({ids[i]: drafts[ids[i]] for i in spec}, num_accepted, device_drafts)

    @staticmethod
    def _device_drafts(batch: BatchInputs, spec: list[int], drafts: dict[str, list[int]]) -> torch.Tensor | None:
        """[len(spec), k] the drafted requests' drafts as the step's input ids hold them (-1 past
        a request's drafts), where any is a PLACEHOLDER the device filled in (last_step.py); None
        where the host knows them all."""
        ids = batch.sampled_request_ids
        if not any(PLACEHOLDER in drafts[ids[i]] for i in spec):
            return None
        padded = torch.cat([batch.input_ids, batch.input_ids.new_full((1,), -1)])  # draft_index's past-the-end: -1
        return padded[batch.index["draft_index"]]

    def _token_bitmask(self, request_ids: list[str], states: list[RunnerRequest],
                       drafts: list[list[int]] | None = None):
        """The constrained rows' token bitmask on the device, or None. Filled on the host while
        the device runs the forward pass launched before it. `drafts`: a verify step's, one
        list per request (its 1 + k logits rows; GrammarMatchers.bitmask)."""
        if not self.matchers:
            return None
        mask = self.matchers.bitmask([(rid, st.token_ids, st.num_prompt_tokens)
                                      for rid, st in zip(request_ids, states)], drafts)
        return mask.to(self.device) if mask is not None else None
