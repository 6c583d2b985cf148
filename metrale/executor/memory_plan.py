"""The memory plan: what the server will hold on its device, decided before anything is allocated.

    weights            exact, from the parameters of the model built on the meta device
    activation reserve estimated before loading; on CUDA measured by a profiling forward pass
                       at the largest step (max_num_batched_tokens) once the weights are in
    encoder reserve    vision-language models: the encoder cache (the encoder budget's rows at the
                       text width) and the vision tower's activations for the largest item the
                       processor allows (max_pixels), estimated (estimate_encoder_bytes)
    state slots        models with per-request state (linear attention): one slot per running
                       sequence, the prefix cache's checkpoints, and a padding slot, at
                       state_bytes_per_slot; with speculative decoding also k scratch slots per
                       running sequence (the state after each draft of a verify step)
    KV cache           what is left of the budget, in whole blocks, at kv_bytes_per_token
    budget             device total x --gpu-memory-utilization (CUDA), or --kv-cache-memory

The per-token and per-slot sizes come from the cache layout (executor/cache_layout.py). If the
weights, the reserve, the state slots and one full-length sequence's KV do not fit in the
budget, startup stops before allocating anything, with the plan and the flags that would make
it fit.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

from metrale.config.errors import StartupError

logger = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 2 * GiB
# A CUDA context, cuBLAS workspaces and the NCCL buffers are outside torch's allocator.
CUDA_RUNTIME_OVERHEAD_BYTES = 768 * MiB


class MemoryPlanError(StartupError, RuntimeError):
    pass


@dataclass
class MemoryPlan:
    device: str
    device_total_bytes: int
    budget_bytes: int
    weight_bytes: int
    activation_reserve_bytes: int
    activation_measured: bool
    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    requested_max_num_seqs: int | str  # --max-num-seqs: a count or "auto"
    num_kv_blocks: int = 0
    runtime_overhead_bytes: int = 0
    state_bytes_per_slot: int = 0  # 0: the model keeps no per-request state
    requested_checkpoint_slots: int | str = 0  # --state-checkpoint-slots: a count or "auto"
    # Speculative decoding's k on a model with state: a verify step keeps each running sequence's
    # state after each draft, in k scratch slots per sequence (layers/linear_attention/draft_states.py).
    draft_slots_per_seq: int = 0
    encoder_reserve_bytes: int = 0  # vision-language models (estimate_encoder_bytes); 0 for text models
    encoder_summary: str = ""
    # Resolved by fit_kv_blocks (and, for "auto" without state, from the KV capacity after it).
    max_num_seqs: int = 0
    num_checkpoint_slots: int = 0
    cache_summary: list[str] = field(default_factory=list)  # CacheLayout.summary()
    weight_format: str = ""  # e.g. the FP8 layout (config/quantization.py describe()); "" for the model dtype
    notes: list[str] = field(default_factory=list)
    host_baseline_bytes: int | None = None  # resident host memory before any backend existed (startup)
    # Above one rank: every rank's rank_memory() and host memory at the end of startup, by rank.
    ranks: list[dict] = field(default_factory=list)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def num_state_slots(self) -> int:
        """Slots the scheduler hands out (running sequences and checkpoints; the padding slot
        comes on top), 0 for a model without per-request state."""
        return self.max_num_seqs + self.num_checkpoint_slots if self.state_bytes_per_slot else 0

    @property
    def num_draft_state_slots(self) -> int:
        """Verify steps' scratch slots (speculative decoding), after the scheduler's slots."""
        return self.max_num_seqs * self.draft_slots_per_seq if self.state_bytes_per_slot else 0

    @property
    def state_cache_bytes(self) -> int:
        return (self.state_bytes_per_slot * (self.num_state_slots + self.num_draft_state_slots + 1)
                if self.state_bytes_per_slot else 0)

    @property
    def predicted_bytes(self) -> int:
        return (self.weight_bytes + self.activation_reserve_bytes + self.encoder_reserve_bytes + self.kv_cache_bytes
                + self.state_cache_bytes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(kv_cache_bytes=self.kv_cache_bytes, kv_capacity_tokens=self.kv_capacity_tokens,
                   num_state_slots=self.num_state_slots, num_draft_state_slots=self.num_draft_state_slots,
                   state_cache_bytes=self.state_cache_bytes,
                   predicted_bytes=self.predicted_bytes)
        return out

    def table(self) -> str:
        rows = [
            ("device", f"{self.device}, {self.device_total_bytes / GiB:.1f} GiB"),
            ("budget", f"{self.budget_bytes / GiB:.2f} GiB"),
            ("weights", f"{self.weight_bytes / GiB:.2f} GiB" + (f" ({self.weight_format})" if self.weight_format else "")),
            ("activation reserve", f"{self.activation_reserve_bytes / GiB:.2f} GiB "
                                   f"({'measured' if self.activation_measured else 'estimated'})"),
            *([("encoder reserve", f"{self.encoder_reserve_bytes / GiB:.2f} GiB (estimated: {self.encoder_summary})")]
              if self.encoder_reserve_bytes else []),
            ("runtime overhead", f"{self.runtime_overhead_bytes / GiB:.2f} GiB"),
            ("KV bytes per token", f"{self.kv_bytes_per_token:,}"),
            ("KV cache", f"{self.kv_cache_bytes / GiB:.2f} GiB = {self.num_kv_blocks:,} blocks x {self.block_size} "
                         f"tokens = {self.kv_capacity_tokens:,} tokens"),
        ]
        if self.state_bytes_per_slot:
            rows += [
                ("state bytes per request", f"{self.state_bytes_per_slot:,}"),
                ("state slots", f"{self.state_cache_bytes / GiB:.2f} GiB = {self.max_num_seqs} running + "
                                f"{self.num_checkpoint_slots} prefix checkpoints + 1 padding"
                                + (f" + {self.num_draft_state_slots} draft scratch ({self.max_num_seqs} x "
                                   f"{self.draft_slots_per_seq})" if self.num_draft_state_slots else "")),
            ]
        rows += [
            ("context length", f"{self.max_model_len:,} tokens"),
            ("max running sequences", f"{self.max_num_seqs}"),
        ]
        rows += [("cache", line) for line in self.cache_summary]
        width = max(len(name) for name, _ in rows)
        lines = [f"  {name:<{width}}  {value}" for name, value in rows]
        lines += [f"  note: {note}" for note in self.notes]
        return "memory plan\n" + "\n".join(lines)


def parameter_bytes(model: torch.nn.Module) -> int:
    """The weights' bytes: every parameter once, plus what modules derive from their weights
    after loading and keep (`derived_weight_bytes()`: MLA's dequantized W_UK / W_UV of an FP8
    kv_b_proj)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for module in model.modules():
        derived = getattr(module, "derived_weight_bytes", None)
        if derived is not None:
            total += derived()
    return total


def estimate_activation_bytes(hf_config, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int,
                              vocab_size: int) -> int:
    """Peak transient memory of one step, before it can be measured: the widest intermediate
    (MLP gate+up and its activation, or Q/K/V) for every token, a few hidden-size buffers, and
    float32 logits with the sampler's working copies for every sampled row."""
    element = torch.finfo(dtype).bits // 8
    hidden = hf_config.hidden_size
    intermediate = max(getattr(hf_config, "intermediate_size", 4 * hidden) or 0,
                       (getattr(hf_config, "moe_intermediate_size", 0) or 0)
                       * (getattr(hf_config, "num_experts_per_tok", 1) or 1))
    per_token = element * (3 * intermediate + 6 * hidden)
    logits = 4 * 4 * min(max_num_seqs, max_num_batched_tokens) * vocab_size
    return max_num_batched_tokens * per_token + logits


def estimate_encoder_bytes(vision_config, text_hidden: int, dtype: torch.dtype, max_pixels: int,
                           encoder_rows: int, width_factor: int = 1) -> tuple[int, str]:
    """(bytes, summary) of a vision-language model's encoder reserve: the encoder cache of
    `encoder_rows` rows of text_hidden * width_factor (DeepStack models keep wider rows), plus the
    tower's transient memory for one item of `max_pixels`: per patch its widest intermediate and
    a few hidden-size buffers (q, k, v and the output among them). No attention scores: the
    tower's attention is unmasked SDPA per segment (layers/vision/attention.py), which runs a
    flash or memory-efficient kernel on CUDA and on the CPU and never holds patches^2 scores (for
    Qwen2.5-VL's default 12.8 Mpx that would be 275 GB, and no model would start)."""
    element = torch.finfo(dtype).bits // 8
    patch = int(getattr(vision_config, "patch_size", 14))
    temporal = int(getattr(vision_config, "temporal_patch_size", 2))
    patches = max(1, max_pixels // (patch * patch))
    hidden = int(getattr(vision_config, "hidden_size", None) or getattr(vision_config, "embed_dim", 1280))
    intermediate = int(getattr(vision_config, "intermediate_size", 0) or 4 * hidden)
    inputs = patches * 3 * temporal * patch * patch * 4
    per_patch = element * (3 * intermediate + 6 * hidden)
    cache = encoder_rows * text_hidden * width_factor * element
    total = inputs + patches * per_patch + cache
    return total, (f"cache {encoder_rows:,} rows x {text_hidden * width_factor}, one item of {max_pixels:,} pixels "
                   f"= {patches:,} patches")


def _left_for_caches(plan: MemoryPlan) -> int:
    return (plan.budget_bytes - plan.weight_bytes - plan.activation_reserve_bytes - plan.encoder_reserve_bytes
            - plan.runtime_overhead_bytes)


def _typical_seq_tokens(max_model_len: int) -> int:
    return max(1, min(max_model_len // 4, 4096))


def _resolve_state_slots(plan: MemoryPlan) -> None:
    """Running sequences and checkpoints of a model with per-request state, before the blocks:
    `auto` running sequences as many as fit at a quarter of the context each (KV and state, the
    checkpoints and the draft scratch slots counted in), between 8 and 1024, a multiple of 8; `auto` checkpoints a quarter of
    that, at least 8."""
    auto_checkpoints = plan.requested_checkpoint_slots == "auto"
    if plan.requested_max_num_seqs == "auto":
        per_seq = (_typical_seq_tokens(plan.max_model_len) * plan.kv_bytes_per_token
                   + plan.state_bytes_per_slot * ((1.25 if auto_checkpoints else 1.0) + plan.draft_slots_per_seq))
        fixed = plan.state_bytes_per_slot * (1 + (0 if auto_checkpoints else plan.requested_checkpoint_slots))
        plan.max_num_seqs = max(8, min(1024, int(max(0, _left_for_caches(plan) - fixed) // per_seq) // 8 * 8))
    else:
        plan.max_num_seqs = int(plan.requested_max_num_seqs)
    plan.num_checkpoint_slots = (max(8, plan.max_num_seqs // 4) if auto_checkpoints
                                 else int(plan.requested_checkpoint_slots))


def fit_kv_blocks(plan: MemoryPlan, fixed_blocks: int | None = None) -> MemoryPlan:
    """Fill the plan's KV cache from what the budget leaves after the state slots; refuse a plan
    that cannot hold one full-length sequence."""
    blocks_per_seq = -(-plan.max_model_len // plan.block_size)
    if plan.state_bytes_per_slot:
        _resolve_state_slots(plan)
    else:
        plan.num_checkpoint_slots = 0
        plan.max_num_seqs = 0 if plan.requested_max_num_seqs == "auto" else int(plan.requested_max_num_seqs)
    if fixed_blocks is not None:
        plan.num_kv_blocks = fixed_blocks
        if fixed_blocks < blocks_per_seq:
            note = (f"--num-kv-blocks {fixed_blocks} holds {fixed_blocks * plan.block_size:,} tokens, less than one "
                    f"full-length sequence ({plan.max_model_len:,}): a request that outgrows the pool ends "
                    f"with finish_reason 'length'")
            if note not in plan.notes:  # fitted twice on CUDA: before and after measuring
                plan.notes.append(note)
                logger.warning("%s", note)
        return plan
    left = _left_for_caches(plan) - plan.state_cache_bytes
    seqs_cap = plan.max_num_seqs or (1 << 30)  # 0: "auto", resolved from the capacity afterwards
    blocks = max(0, left // plan.kv_bytes_per_block) if plan.kv_bytes_per_block else seqs_cap * blocks_per_seq
    if blocks < blocks_per_seq:
        plan.num_kv_blocks = blocks
        state = (f" and {plan.num_state_slots + 1} state slots ({plan.state_cache_bytes / GiB:.2f} GiB)"
                 if plan.state_bytes_per_slot else "")
        raise MemoryPlanError(
            f"the model does not fit: after the weights, the activation reserve{state}, the KV cache gets "
            f"{blocks * plan.block_size:,} tokens but one full-length sequence needs {plan.max_model_len:,}.\n"
            f"{plan.table()}\n"
            "To make it fit: lower --max-model-len, raise --gpu-memory-utilization (or --kv-cache-memory), "
            "lower --max-num-batched-tokens (smaller activation reserve), use --kv-cache-dtype fp8, "
            + ("lower --max-num-seqs or --state-checkpoint-slots (fewer state slots), " if state else "")
            + "or split the model with --tp-size.")
    plan.num_kv_blocks = min(blocks, seqs_cap * blocks_per_seq)
    note = f"KV cache capped at max_num_seqs x context ({plan.max_num_seqs} x {plan.max_model_len})"
    if plan.num_kv_blocks < blocks and note not in plan.notes:  # fitted twice on CUDA: before and after measuring
        plan.notes.append(note)
    return plan


def finish_plan(plan: MemoryPlan) -> MemoryPlan:
    """After the blocks are fitted: `auto` running sequences of a model without state follow the
    KV capacity."""
    if not plan.max_num_seqs:
        plan.max_num_seqs = resolve_max_num_seqs("auto", plan.kv_capacity_tokens, plan.max_model_len)
    return plan


def resolve_max_num_seqs(requested: int | str, capacity_tokens: int, max_model_len: int) -> int:
    """`auto`: as many sequences as the pool holds at a quarter of the context (at most 4096
    tokens each), between 8 and 1024, a multiple of 8."""
    if requested != "auto":
        return int(requested)
    seqs = capacity_tokens // _typical_seq_tokens(max_model_len)
    return max(8, min(1024, seqs // 8 * 8))


def memory_ledger(engine) -> dict:
    """Every byte the engine holds on its device, live: weights, KV pool, activation reserve,
    CUDA graphs, other torch allocations; device total and free; and the startup plan."""
    ledger = rank_memory(engine.runner, engine.memory_plan)
    ledger["plan"] = engine.memory_plan.to_dict()
    return ledger


def rank_memory(runner, plan: MemoryPlan) -> dict:
    """What one rank's runner holds on its device now (memory_ledger without the plan)."""
    device = runner.device
    weights = parameter_bytes(runner.model) + sum(b.numel() * b.element_size() for b in runner.model.buffers())
    caches = runner.caches
    kv_cache, state_cache = (caches.paged_bytes, caches.state_bytes) if caches else (0, 0)
    graphs = sum(g.memory_bytes for g in (runner.graphs, runner.verify_graphs, runner.prefill_graphs) if g is not None)
    ledger = {"device": str(device), "weights_bytes": weights, "kv_cache_bytes": kv_cache,
              "state_cache_bytes": state_cache,
              "activation_reserve_bytes": plan.activation_reserve_bytes,
              "activation_reserve_measured": plan.activation_measured,
              "cuda_graphs_bytes": graphs}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        ledger.update(total_bytes=total, free_bytes=free, torch_allocated_bytes=allocated,
                      torch_reserved_bytes=torch.cuda.memory_reserved(device),
                      other_torch_bytes=max(0, allocated - weights - kv_cache - state_cache))
    return ledger
