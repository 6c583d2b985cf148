"""The sampler: from the last position's logits to one token per request, where the logits are.

Order, as vLLM: logprobs of the raw model output; min_tokens masking of stop ids; logit_bias;
repetition, frequency and presence penalties; the structured-output token bitmask (tokens a
request's grammar does not allow get -inf); then greedy argmax, or temperature, top-k, top-p and
min-p and a draw. Every draw comes from a stream keyed by (request seed, output index), so a request's
tokens do not depend on its batch or on being preempted and recomputed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import TokenLogprobs
from metrale.kernels import use_triton
from metrale.kernels.token_bitmask import apply_token_bitmask

_MASK64 = (1 << 64) - 1


def _to_signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_to_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def stream_seeds(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """stream_seed of each (seed, index), on the tensors' device, as int64 bit patterns: for
    output indices only the device knows (a step planned over a verify step in flight). int64
    arithmetic wraps modulo 2^64 as the host's masked one does; a right shift is logical once
    its sign bits are masked off."""
    z = seeds * _GOLDEN + indices + 1
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def stream_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): independent, reproducible per-draw seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class SamplingRow:
    """One request to sample for. `token_ids` is the request's whole sequence (prompt, then
    outputs), shared with the runner, never copied on the hot path."""

    params: SamplingParams
    seed: int
    token_ids: list[int]
    num_prompt_tokens: int
    # Outputs the host has not read beyond one placeholder per step in flight: the drafts a verify
    # step in flight accepted, where the request was planned over it (read from the device).
    index_shift: int = 0

    @property
    def num_output_tokens(self) -> int:
        """The output index of the request's next token (its random streams are keyed by it)."""
        return len(self.token_ids) - self.num_prompt_tokens + self.index_shift

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def shifted_rows(rows: list[SamplingRow], index_shift: torch.Tensor) -> list[SamplingRow]:
    """The rows with the device's index shift read back and added (one wait for the device)."""
    return [dataclasses.replace(row, index_shift=row.index_shift + shift)
            for row, shift in zip(rows, index_shift.tolist())]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.min_tokens and row.num_output_tokens < p.min_tokens:
            banned = list(set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids)))
            if banned:
                logits[i, banned] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if not p.has_penalties:
            continue
        vocab = logits.shape[1]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in row.token_ids if t < vocab}),
                                dtype=torch.long, device=logits.device)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if row.num_output_tokens and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(row.output_token_ids, device=logits.device), minlength=vocab)[:vocab]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without waiting for it (pinned, then copied behind the queued work;
    a list copied from pageable memory waits for the device)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks, row by row in one pass."""
    device = logits.device
    temperature = column([r.params.temperature for r in rows], torch.float32, device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[1]
    top_k = column([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows], torch.int64, device)
    top_p = column([r.params.top_p for r in rows], torch.float32, device)
    min_p = column([r.params.min_p for r in rows], torch.float32, device)
    if (top_k < vocab).any() or (top_p < 1.0).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
        drop |= (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
        drop[:, 0] = False
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if (min_p > 0).any():
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Exponential race (equivalent to sampling from softmax(logits)) with per-request streams."""
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, row in enumerate(rows):
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(stream_seed(row.seed, row.num_output_tokens))
        noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _sample_on_gpu(logits: torch.Tensor, rows: list[SamplingRow],
                   index_shift: torch.Tensor | None = None) -> torch.Tensor:
    """The fused Triton sampler: filters and a counter-based draw per row, no host sync.
    Its random streams differ from the CPU path's; each is deterministic and batch-invariant.
    `index_shift`: int64 [len(rows)] on the device, added to each row's output index."""
    from metrale.kernels.sampling import sample_tokens_triton

    vocab, device = logits.shape[1], logits.device
    sampled = [r.params for r in rows if not r.params.greedy]  # greedy rows ignore the filters
    offsets = column([r.num_output_tokens for r in rows], torch.int64, device)
    return sample_tokens_triton(
        logits.contiguous(),
        column([r.params.temperature for r in rows], torch.float32, device),
        column([r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows], torch.int64, device),
        column([r.params.top_p for r in rows], torch.float32, device),
        column([r.params.min_p for r in rows], torch.float32, device),
        column([r.seed & 0x7FFFFFFFFFFFFFFF for r in rows], torch.int64, device),
        offsets if index_shift is None else offsets + index_shift,
        any_top_k=any(0 < p.top_k < vocab for p in sampled), any_top_p=any(p.top_p < 1.0 for p in sampled),
        any_min_p=any(p.min_p > 0 for p in sampled))


def _logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> list[tuple]:
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    ranks = (raw_logprobs > chosen[:, None]).sum(dim=-1) + 1
    top = raw_logprobs.topk(k, dim=-1) if k > 0 else None
    chosen, ranks = chosen.tolist(), ranks.tolist()
    top_values = top.values.tolist() if top is not None else [[] for _ in chosen]
    top_ids = top.indices.tolist() if top is not None else [[] for _ in chosen]
    return list(zip(chosen, ranks, top_ids, top_values))


@dataclass
class SampledTokens:
    """A step's draws, still on the logits' device: reading them is the step's only host sync."""

    tokens: torch.Tensor  # int64 [len(rows)]
    rows: list[SamplingRow]
    want_logprobs: list[int]  # rows that asked for logprobs
    raw_logprobs: torch.Tensor | None  # [len(want_logprobs), vocab], from the raw logits
    # A verify step's drafted rows that asked for logprobs: row -> the raw logprobs of its
    # 1 + drafts positions [1 + drafts, vocab] (such rows are not in want_logprobs)
    draft_raw_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)

    def logprobs(self, token_list: list[int]) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(self.rows)
        if not self.want_logprobs:
            return out
        k = max(self.rows[i].params.logprobs for i in self.want_logprobs)
        chosen = torch.tensor([token_list[i] for i in self.want_logprobs], device=self.tokens.device)
        for i, (lp, rank, ids, values) in zip(self.want_logprobs, _logprobs(self.raw_logprobs, chosen, k)):
            n = self.rows[i].params.logprobs
            out[i] = TokenLogprobs(token_list[i], lp, rank, ids[:n], values[:n])
        return out

    def draft_logprobs(self, emitted: dict[int, list[int]]) -> dict[int, list[TokenLogprobs]]:
        """For the drafted rows that asked for logprobs: the logprobs of each token the verify step
        gives them (emitted[row]: the accepted drafts, then the sampled token), each from the raw
        logits of its own position, as a plain step at that position would report it."""
        rows = [i for i in self.draft_raw_logprobs if i in emitted]
        if not rows:
            return {}
        k = max(self.rows[i].params.logprobs for i in rows)
        raw = torch.cat([self.draft_raw_logprobs[i][:len(emitted[i])] for i in rows])
        chosen = torch.tensor([t for i in rows for t in emitted[i]], device=raw.device)
        entries = iter(_logprobs(raw, chosen, k))
        out = {}
        for i in rows:
            n = self.rows[i].params.logprobs
            out[i] = [TokenLogprobs(token, lp, rank, ids[:n], values[:n])
                      for token, (lp, rank, ids, values) in zip(emitted[i], entries)]
        return out


def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow],
                  token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
                  index_shift: torch.Tensor | None = None) -> SampledTokens:
    """logits: [len(rows), vocab] for the last position of each sampled request, in the model's
    dtype. No host sync. Everything is computed on logits widened to fp32; the Triton sampler
    and the greedy argmax widen as they read (exact), so a batch with no penalties and no
    logit bias costs no fp32 copy of its logits. `token_bitmask`: (row indices, packed int32
    bitmask) of the constrained rows, on the logits' device; it masks the logits in place, after
    the raw logprobs are taken (the caller hands over logits it does not read again).
    `index_shift`: int64 [len(rows)] on the device, outputs each row's output index lacks (a
    request planned over a verify step in flight: SamplingRow.index_shift, not read yet)."""
    want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].float().log_softmax(dim=-1) if want_logprobs else None
    if any(r.params.changes_logits for r in rows):
        logits = logits.to(torch.float32, copy=True)
        _apply_penalties(logits, rows)
    if token_bitmask is not None:
        constrained_rows, bitmask = token_bitmask
        apply_token_bitmask(logits, bitmask, constrained_rows)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows and use_triton(logits):
        tokens = _sample_on_gpu(logits, rows, index_shift)
        random_rows = []
    else:
        tokens = logits.argmax(dim=-1)  # the first maximum, as of the fp32 values
    if random_rows and index_shift is not None:  # the reference reads the shift (waits for the device)
        rows = shifted_rows(rows, index_shift)
    if random_rows:
        subset = [rows[i] for i in random_rows]
        index = torch.tensor(random_rows, device=logits.device)
        tokens[index] = _draw(_filter(logits[index].float(), subset), subset)
    return SampledTokens(tokens, rows, want_logprobs, raw_logprobs)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """sample_tokens, read back at once: (token ids, logprobs per row or None)."""
    sampled = sample_tokens(logits, rows)
    token_list = sampled.tokens.tolist()
    return token_list, sampled.logprobs(token_list)
