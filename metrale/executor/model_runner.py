"""The model runner: the only place that builds tensors.

It keeps each running request's tokens and block table (sent whole once, then as diffs), turns
a SchedulerOutput into one flattened batch (input ids, positions, slot mapping, block tables,
sequence lengths), runs the model under a ForwardContext, and samples where the logits are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from metrale.config.model_config import ModelConfig
from metrale.engine.request import PLACEHOLDER  # its value is on the device; the next step's input takes it there
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from metrale.executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from metrale.executor.sampler import SampledTokens, SamplingRow, sample, sample_tokens
from metrale.layers.attention.backend import get_backend
from metrale.layers.attention.layer import Attention

logger = logging.getLogger(__name__)



@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    sampled_request_ids: list[str]


class PendingOutput:
    """A launched step's sampled tokens, copied to the host without blocking. `result()` waits for
    them, writes them over the runner's placeholders, and builds the ModelRunnerOutput."""

    def __init__(self, runner: "ModelRunner", request_ids: list[str], positions: list[int],
                 sampled: SampledTokens | None):
        self.runner, self.request_ids, self.positions, self.sampled = runner, request_ids, positions, sampled
        self._result: ModelRunnerOutput | None = None
        self._host = self._event = None
        if sampled is not None and sampled.tokens.is_cuda:
            self._host = torch.empty(sampled.tokens.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(sampled.tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> ModelRunnerOutput:
        if self._result is not None:
            return self._result
        out = ModelRunnerOutput()
        if self.sampled is not None:
            if self._event is not None:
                self._event.synchronize()
                tokens = self._host.tolist()
            else:
                tokens = self.sampled.tokens.tolist()
            logprobs = self.sampled.logprobs(tokens)
            for request_id, position, token, lp in zip(self.request_ids, self.positions, tokens, logprobs):
                state = self.runner.requests.get(request_id)
                if state is not None and position < len(state.token_ids) and state.token_ids[position] == PLACEHOLDER:
                    state.token_ids[position] = token
                out.sampled_token_ids[request_id] = token
                if lp is not None:
                    out.logprobs[request_id] = lp
        self._result = out
        return out


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, device: torch.device,
                 block_size: int, attention_backend: str = "auto", kv_cache_dtypes: list | None = None):
        self.model = model
        self.model_config = model_config
        self.device = device
        self.block_size = block_size
        self.backend = get_backend(attention_backend, device)
        # Each request this runner knows: the plan's NewRequestData, adopted as the runner's own
        # state (its token_ids grow by the sampled tokens, its block_ids by each step's blocks).
        self.requests: dict[str, NewRequestData] = {}
        self.kv_caches: list[torch.Tensor] = []  # per layer: [2, num_blocks, block_size, kv_heads, head_dim]
        self._pin = device.type == "cuda"
        self.graphs = None  # DecodeGraphs, once captured
        # The last launched step's sampled tokens on the device, and each request's row in them.
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        layers = self.attention_layers()
        # The KV element type of each attention layer, in model order (an fp8 cache may keep some
        # layers in the model dtype).
        self.kv_cache_dtypes = kv_cache_dtypes or [model_config.dtype] * len(layers)
        for layer, dtype in zip(layers, self.kv_cache_dtypes):
            if dtype != torch.float8_e4m3fn:  # scales mean something only to an fp8 cache
                layer.k_scale = layer.v_scale = 1.0

    def release_cuda_graphs(self) -> None:
        """Back to eager decode steps (before shutting a multi-rank engine's groups down)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        from metrale.executor.cuda_graphs import DecodeGraphs

        if self.device.type != "cuda" or not self.backend.supports_cuda_graphs:
            return
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.backend, self.device, max_num_seqs, max_blocks, max_model_len)
        self.graphs.capture()

    # -- the KV cache --------------------------------------------------------------------------

    @staticmethod
    def attention_layers_of(model: torch.nn.Module) -> list[Attention]:
        return [m for m in model.modules() if isinstance(m, Attention)]

    def attention_layers(self) -> list[Attention]:
        return self.attention_layers_of(self.model)

    def kv_bytes_per_block(self) -> int:
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_dim * dtype.itemsize
                   for layer, dtype in zip(self.attention_layers(), self.kv_cache_dtypes))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer, bound to it."""
        self.kv_caches = []
        for layer, dtype in zip(self.attention_layers(), self.kv_cache_dtypes):
            cache = torch.empty(2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                                dtype=dtype, device=self.device)
            layer.kv_cache = (cache[0], cache[1])
            self.kv_caches.append(cache)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        sources = torch.tensor([s for s, _ in pairs], device=self.device)
        destinations = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.kv_caches:
            cache[:, destinations] = cache[:, sources]

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, num_sampled: int, max_model_len: int) -> int:
        """Peak transient memory of the largest step, measured on CUDA: a forward pass over
        `num_tokens` tokens (as sequences of at most `max_model_len`), then logits and the sampler
        for `num_sampled` rows. A throwaway KV cache just large enough is used and freed."""
        lengths = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
        self.allocate_kv_cache(sum(-(-n // self.block_size) for n in lengths))
        plan = self.prefill_plan([[1] * n for n in lengths], "__profile")
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        hidden = self.forward_whole(plan)
        rows = min(num_sampled, hidden.shape[0])
        logits = self.model.compute_logits(hidden[:rows])
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        sample(logits, [SamplingRow(params, i, [1], 1) for i in range(rows)])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del hidden, logits
        self.requests.clear()
        self.release_kv_cache()
        return peak

    @torch.inference_mode()
    def calibrate_kv_scales(self, token_ids: list[int], headroom: float, max_model_len: int) -> None:
        """Set each fp8 layer's K and V scale from the largest values a forward pass over
        `token_ids` produces (in chunks of at most max_model_len): amax x headroom maps to 448."""
        layers = self.attention_layers()
        for layer in layers:
            layer.observed_amax = [0.0, 0.0]
        for start in range(0, len(token_ids), max_model_len):  # one sequence at a time, from block 0
            self.forward_whole(self.prefill_plan([token_ids[start:start + max_model_len]], "__calibrate"))
            self.requests.clear()
        for layer, dtype in zip(layers, self.kv_cache_dtypes):
            k_amax, v_amax = layer.observed_amax
            layer.observed_amax = None
            if dtype == torch.float8_e4m3fn:
                layer.k_scale = max(k_amax * headroom / 448.0, 1e-6)
                layer.v_scale = max(v_amax * headroom / 448.0, 1e-6)

    def prefill_plan(self, sequences: list[list[int]], tag: str) -> SchedulerOutput:
        """A plan computing whole `sequences` at once, laid out in consecutive blocks from block 0
        (startup passes only: nothing else holds the pool then)."""
        plan, first_block = SchedulerOutput(), 0
        for i, tokens in enumerate(sequences):
            blocks = -(-len(tokens) // self.block_size)
            plan.new_requests.append(NewRequestData(f"{tag}_{i}", tokens, len(tokens), SamplingParams(temperature=0),
                                                    0, list(range(first_block, first_block + blocks)), 0))
            plan.num_scheduled_tokens[f"{tag}_{i}"] = len(tokens)
            first_block += blocks
        return plan

    def forward_whole(self, plan: SchedulerOutput) -> torch.Tensor:
        """The hidden states of every token of a startup plan (no sampling)."""
        self._apply_plan(plan)
        batch = self.prepare_inputs(plan)
        with set_forward_context(ForwardContext(batch.metadata, self.backend)):
            return self.model(batch.input_ids, batch.positions)

    def release_kv_cache(self) -> None:
        for layer in self.attention_layers():
            layer.kv_cache = None
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- one step ------------------------------------------------------------------------------

    def _apply_plan(self, plan: SchedulerOutput) -> None:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = new  # the scheduler built its lists for this plan alone
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

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
        seq_lens = starts + query_lens
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        width = max(len(st.block_ids) for _, st, _ in scheduled)
        tables = np.zeros((num_seqs, width), dtype=np.int32)
        for i, (_, st, _) in enumerate(scheduled):
            tables[i, :len(st.block_ids)] = st.block_ids
        if int(query_lens.max()) == 1:  # pure decode: one token each, no per-request slicing
            input_ids = np.fromiter((st.token_ids[st.num_computed_tokens] for _, st, _ in scheduled),
                                    dtype=np.int64, count=num_seqs)
            positions = starts
            seq_index = np.arange(num_seqs)
        else:
            input_ids = np.concatenate([st.token_ids[st.num_computed_tokens:st.num_computed_tokens + n]
                                        for _, st, n in scheduled]).astype(np.int64, copy=False)
            seq_index = np.repeat(np.arange(num_seqs), query_lens)
            positions = starts[seq_index] + (np.arange(len(input_ids)) - query_start[:-1][seq_index])
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        sampled_rows = [i for i, (_, st, _) in enumerate(scheduled) if seq_lens[i] == len(st.token_ids)]
        logits_indices = query_start[1:][sampled_rows] - 1
        holes = np.flatnonzero(input_ids == PLACEHOLDER)
        wide = {"input_ids": input_ids, "positions": positions, "slots": slots, "logits_indices": logits_indices}
        if holes.size:  # tokens the previous step sampled and the host has not read yet: from the device
            wide["holes"] = holes
            wide["hole_rows"] = np.fromiter((self._last_rows[scheduled[i][0]] for i in seq_index[holes]),
                                            dtype=np.int64, count=holes.size)
        dev = self._upload(wide, torch.int64)
        dev.update(self._upload({"tables": tables, "seq_lens": seq_lens, "query_start": query_start}, torch.int32))
        if holes.size:
            dev["input_ids"][dev["holes"]] = self._last_tokens[dev["hole_rows"]]
        metadata = AttentionMetadata(
            slot_mapping=dev["slots"], block_tables=dev["tables"], seq_lens=dev["seq_lens"],
            query_start_loc=dev["query_start"],
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
            seq_lens_cpu=seq_lens.tolist(), query_lens_cpu=query_lens.tolist())
        return BatchInputs(dev["input_ids"], dev["positions"], metadata, dev["logits_indices"],
                           [scheduled[i][0] for i in sampled_rows])

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(plan).result()

    @torch.inference_mode()
    def execute_async(self, plan: SchedulerOutput) -> PendingOutput:
        """Launch one step. Each sampled request gets a placeholder token until `result()`."""
        self._apply_plan(plan)
        if plan.block_copies:
            self.copy_blocks(plan.block_copies)
        if plan.is_empty:
            return PendingOutput(self, [], [], None)
        batch = self.prepare_inputs(plan)
        num_tokens = batch.input_ids.shape[0]
        if (self.graphs is not None and batch.metadata.is_pure_decode
                and len(batch.sampled_request_ids) == num_tokens and self.graphs.can_run(num_tokens)):
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.metadata)
        else:
            with set_forward_context(ForwardContext(batch.metadata, self.backend)):
                hidden = self.model(batch.input_ids, batch.positions)
            if not batch.sampled_request_ids:
                return PendingOutput(self, [], [], None)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        states = [self.requests[request_id] for request_id in batch.sampled_request_ids]
        sampled = sample_tokens(logits, [SamplingRow(st.sampling_params, st.seed, st.token_ids, st.num_prompt_tokens)
                                         for st in states])
        positions = []
        for state in states:
            positions.append(len(state.token_ids))
            state.token_ids.append(PLACEHOLDER)
        self._last_tokens = sampled.tokens
        self._last_rows = {request_id: row for row, request_id in enumerate(batch.sampled_request_ids)}
        return PendingOutput(self, batch.sampled_request_ids, positions, sampled)
