"""The rejection sampler of speculative decoding: verify a request's drafts against the target.

A verify step computes the target's logits at 1 + k positions of a request: after its last known
token and after each of its k drafts. Position j's distribution is the one plain decoding would
sample from there, given drafts[:j] as the request's latest outputs: the same penalties,
min_tokens, logit_bias, temperature, top-k, top-p and min-p (executor/sampler.py), the same
stream key (seed, output index).

- Greedy: draft j is accepted while it is the argmax at position j; the token after the
  accepted drafts is the argmax where the first draft failed (or after the last). Exactly the
  tokens plain greedy decoding gives.
- Sampled: the drafter (n-gram) gives no distribution, so a draft is a point mass q = onehot(d).
  Draft j is accepted with probability min(1, p_j(d) / q(d)) = p_j(d); at the first rejection the
  token is drawn from the residual max(p_j - q, 0), normalised (p_j with d removed); when every
  draft is accepted, the bonus token is drawn from p_k. Each emitted token is distributed as
  p_j (the standard speculative-sampling argument), so the output is distributed as plain
  sampling's. The accept test's uniform and the draw's noise come from the request's own streams
  (keyed by seed and output index), so a seeded request gives the same tokens alone and batched.
  They are counter-based (kernels/rejection_sampling.counter_uniforms: a hash of the stream's key
  and the element), so the Triton kernel draws the same numbers as this reference.
- Sampled, with the draft's distribution q (a drafter that drew its drafts from q_j, given as
  `draft_probs`: [k, vocab] per request, over the same vocabulary as the logits): draft j is
  accepted when u_j * q_j(d) < p_j(d) (probability min(1, p_j(d) / q_j(d))); at the first
  rejection the token is drawn from max(p_j - q_j, 0), normalised; the bonus from p_k as above.
  The same streams. With q = onehot(d) this is the point-mass rule exactly. Only this reference
  takes q: a step with any q runs it (the Triton kernel takes point masses).

Greedy requests whose logits nothing changes take `verify_drafts_greedy` on every device (an
argmax and a comparison); a verify CUDA graph computes the same rule on its padded rows
(`verify_greedy_padded`), and a step whose rows are all such greedy rows takes the graph's result. Otherwise `verify_drafts` is the PyTorch reference (on the logits'
device, no host sync) where the kernels' path is the reference (CPU, `--forward reference`);
elsewhere the same rule runs in the Triton
kernel (kernels/rejection_sampling.py) after the sampler's own penalties and filters per position.
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.executor.sampler import SamplingRow, _apply_penalties, _filter, shifted_rows, stream_seed, stream_seeds
from metrale.kernels import use_triton
from metrale.kernels.rejection_sampling import counter_uniforms_rows, rejection_sample_triton
from metrale.kernels.token_bitmask import apply_token_bitmask

# Mixed into the seed of the accept tests' stream, so it is independent of the draws' stream.
_ACCEPT_SALT = 0x5EC0DEC0DE


def position_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The sampling rows of a verify step's 1 + k positions: position j sees drafts[:j] as outputs."""
    return [SamplingRow(row.params, row.seed, row.token_ids + drafts[:j], row.num_prompt_tokens)
            for j in range(len(drafts) + 1)]


def _streams(device, seed: int, first_index: int, count: int, vocab: int, salt: int = 0):
    """Per-position uniforms (one each: element 0) or exponential noise (vocab each: -log of
    elements 0..vocab-1), one counter-based stream per output index."""
    elements = torch.arange(max(vocab, 1), dtype=torch.int64, device=device)
    if count == 0:
        return torch.empty((0, vocab) if vocab else (0,), device=device)
    out = counter_uniforms_rows([stream_seed(seed ^ salt, first_index + j) for j in range(count)], elements)
    return -out.log() if vocab else out[:, 0]


def verify_drafts(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
                  draft_probs: list[torch.Tensor | None] | None = None, device_drafts: torch.Tensor | None = None,
                  index_shift: torch.Tensor | None = None,
                  token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [sum(1 + len(d) for d in drafts), vocab], each request's positions in order.
    `draft_probs`: per request, the distributions its drafts were drawn from ([len(d), vocab]),
    or None for point masses. A step planned over a verify step in flight (asynchronous
    scheduling) has requests whose drafts, or whose output index, only the device knows:
    `device_drafts` [len(rows), most drafts] (-1 past a request's) where the lists hold
    PLACEHOLDERs, `index_shift` int64 [len(rows)] the outputs each row's count lacks; their
    logits nothing edits. `token_bitmask`: (logits row indices, packed int32 bitmask) of
    constrained requests' positions (structured/matchers.py, each row masked by the grammar's
    state after the drafts before it), applied in place first: the target distribution is the
    constrained one, so a draft the grammar refuses is rejected. Returns (number of drafts
    accepted, the token after them), int64 [len(rows)] each, on the logits' device."""
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask[1], token_bitmask[0])
    if draft_probs is not None and all(q is None for q in draft_probs):
        draft_probs = None
    if draft_probs is None and all(r.params.greedy and not r.params.changes_logits for r in rows):
        return verify_drafts_greedy(logits, drafts, device_drafts)
    if use_triton(logits) and draft_probs is None:
        return verify_drafts_triton(logits, rows, drafts, device_drafts, index_shift)
    if device_drafts is not None or index_shift is not None:  # the reference reads them (waits for the device)
        drafts, rows = _read_device_parts(rows, drafts, device_drafts, index_shift)
    return verify_drafts_reference(logits, rows, drafts, draft_probs)


def _read_device_parts(rows: list[SamplingRow], drafts: list[list[int]], device_drafts: torch.Tensor | None,
                       index_shift: torch.Tensor | None) -> tuple[list[list[int]], list[SamplingRow]]:
    if device_drafts is not None:
        values = device_drafts.tolist()
        drafts = [values[i][:len(d)] for i, d in enumerate(drafts)]
    if index_shift is not None:
        rows = shifted_rows(rows, index_shift)
    return drafts, rows


def verify_drafts_greedy(logits: torch.Tensor, drafts: list[list[int]],
                         device_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows whose logits nothing changes (no penalties, bias or min_tokens): the rule is
    an argmax per position and a comparison, a handful of small launches and one upload on any
    device (the general path's per-step host work costs a batch-1 verify step more than its
    forward's extra rows). `device_drafts`: [len(drafts), max drafts] the drafts on the logits'
    device (-1 past a request's), where the host's lists hold placeholders; the lists then give
    the counts only. Returns what verify_drafts returns."""
    counts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
    starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]]).astype(np.int64)
    width = int(counts.max()) + 1 if len(counts) else 1
    # Request i's positions in a [B, width] grid; past its own 1 + k they repeat its last one,
    # and its padded drafts are -1, which no argmax equals: the cumulative product stops there.
    offsets = np.minimum(np.arange(width)[None, :], counts[:, None])
    grid = starts[:, None] + offsets
    padded = np.full((len(drafts), width - 1), -1, dtype=np.int64)
    if device_drafts is None:
        for i, d in enumerate(drafts):
            padded[i, :len(d)] = d
    host = torch.from_numpy(np.concatenate([grid.ravel(), padded.ravel()]) if device_drafts is None
                            else np.ascontiguousarray(grid.ravel()))
    # Pinned and asynchronous: the host queues the argmax and the comparison behind the verify
    # forward instead of waiting for it at a pageable upload and launching them afterwards.
    both = (host.pin_memory() if logits.is_cuda else host).to(logits.device, non_blocking=True)
    grid_d = both[:grid.size].view(grid.shape)
    drafts_d = both[grid.size:].view(padded.shape) if device_drafts is None else device_drafts[:, :width - 1]
    target = logits.argmax(dim=-1)[grid_d]  # the first maximum, as the plain sampler takes it
    accepted = (target[:, :-1] == drafts_d).long().cumprod(dim=1).sum(dim=1)
    return accepted, target.gather(1, accepted[:, None]).squeeze(1)


def verify_greedy_padded(logits: torch.Tensor, input_ids: torch.Tensor, real_query_lens: torch.Tensor,
                         query_len: int) -> torch.Tensor:
    """The greedy rule on a verify graph's padded rows, with no host input (so the graph computes
    it): sequence i owns rows i*q .. i*q+q-1 of `logits` [B*q, vocab] and `input_ids` [B*q], the
    first real_query_lens[i] of them real (its last token, then its drafts). Draft j of sequence i
    is input_ids[i*q + 1 + j]; it is a draft only for j < real_query_lens[i] - 1. Returns int64
    [2, B]: the token after the accepted drafts, and the number accepted (what verify_drafts_greedy
    gives for the same drafts)."""
    batch = real_query_lens.shape[0]
    target = logits.argmax(dim=-1).view(batch, query_len)  # the first maximum, as the plain sampler takes it
    drafts = input_ids.view(batch, query_len)[:, 1:]
    is_draft = torch.arange(query_len - 1, device=logits.device)[None, :] < (real_query_lens[:, None] - 1)
    accepted = ((target[:, :-1] == drafts) & is_draft).long().cumprod(dim=1).sum(dim=1)
    return torch.stack([target.gather(1, accepted[:, None]).squeeze(1), accepted])


def verify_drafts_triton(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
                         device_drafts: torch.Tensor | None = None,
                         index_shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_drafts through kernels/rejection_sampling.py: the penalties and filters of every
    position as the reference applies them, then one accept / residual / bonus kernel pair. The
    drafts and stream keys of the device (`device_drafts`, `index_shift`: verify_drafts) are
    gathered and hashed there (sampler.stream_seeds), with no wait for it."""
    scores = logits
    if any(r.params.changes_logits for r in rows):
        if device_drafts is not None or index_shift is not None:
            raise ValueError("a request whose logits are edited per position needs its drafts and output index on "
                             "the host")
        flat = [r for row, d in zip(rows, drafts) for r in position_rows(row, d)]
        scores = logits.to(torch.float32, copy=True)
        _apply_penalties(scores, flat)
    else:  # the filters read only the parameters: no copies of the token lists
        flat = [row for row, d in zip(rows, drafts) for _ in range(len(d) + 1)]
    device = logits.device
    counts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
    starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]]).astype(np.int64)
    max_drafts = max(int(counts.max()) if len(counts) else 0,
                     device_drafts.shape[1] if device_drafts is not None else 0)
    sampled = np.fromiter((i for i, r in enumerate(flat) if not r.params.greedy), dtype=np.int64)
    # Row r of request i at position j: its draft (or -1 at the bonus position), its stream index.
    request = np.repeat(np.arange(len(drafts)), counts + 1)
    position = np.arange(len(flat)) - starts[request]
    index = np.fromiter((row.num_output_tokens for row in rows), dtype=np.int64, count=len(rows))[request] + position
    seeds = np.fromiter((_signed(row.seed) for row in rows), dtype=np.int64, count=len(rows))[request]
    if device_drafts is None:
        padded = np.full((len(drafts), max_drafts), -1, dtype=np.int64)
        for i, d in enumerate(drafts):
            padded[i, :len(d)] = d
    else:
        padded = np.zeros((len(drafts), 0), dtype=np.int64)
    # The flat draft index of each row: past the last draft (reads -1) at a bonus position.
    row_source = np.where(position < counts[request], request * max_drafts + position, len(drafts) * max_drafts)
    small = np.concatenate([starts, counts, [not r.params.greedy for r in rows], sampled, padded.ravel(), row_source,
                            index, seeds, request])
    parts = torch.from_numpy(small).pin_memory() if logits.is_cuda else torch.from_numpy(small)
    parts = parts.to(device, non_blocking=True)
    b, r, n = len(drafts), len(flat), len(sampled)
    starts_d, counts_d, sampled_d, sampled_rows = parts[:b], parts[b:2 * b], parts[2 * b:3 * b], parts[3 * b:3 * b + n]
    rest = parts[3 * b + n:]
    drafts_d = (device_drafts if device_drafts is not None else rest[:padded.size].view(b, max_drafts))
    rest = rest[padded.size:]
    row_source_d, index_d, seeds_d, request_d = rest[:r], rest[r:2 * r], rest[2 * r:3 * r], rest[3 * r:]
    if index_shift is not None:
        index_d = index_d + index_shift[request_d]
    flat_drafts = torch.cat([drafts_d.reshape(-1), drafts_d.new_full((1,), -1)])
    row_draft_d = flat_drafts[row_source_d]
    if n:
        if scores is logits:  # never write the caller's logits
            scores = logits.to(torch.float32, copy=True)
        scores[sampled_rows] = _filter(scores[sampled_rows], [flat[i] for i in sampled])
    draw_keys = stream_seeds(seeds_d, index_d)
    accept_keys = stream_seeds(seeds_d ^ _ACCEPT_SALT, index_d)
    return rejection_sample_triton(scores, starts_d.int(), counts_d.int(), drafts_d.int(), (1 - sampled_d).int(),
                                   draw_keys, accept_keys, row_draft_d.int())


def _signed(seed: int) -> int:
    """A 64-bit seed as the int64 with its bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def verify_drafts_reference(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
                            draft_probs: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in PyTorch, request by request (module docstring)."""
    draft_probs = draft_probs if draft_probs is not None else [None] * len(rows)
    device = logits.device
    position_of = [position_rows(row, d) for row, d in zip(rows, drafts)]
    flat = [r for group in position_of for r in group]
    logits = logits.to(torch.float32, copy=True)
    if any(r.params.changes_logits for r in flat):
        _apply_penalties(logits, flat)
    accepted, tokens = [], []
    start = 0
    for row, draft, group, q in zip(rows, drafts, position_of, draft_probs):
        k = len(draft)
        block = logits[start:start + k + 1]
        start += k + 1
        draft_ids = torch.tensor(draft, dtype=torch.int64, device=device)
        if row.params.greedy:
            target = block.argmax(dim=-1)
            num_accepted = (target[:k] == draft_ids).long().cumprod(dim=0).sum()
            accepted.append(num_accepted)
            tokens.append(target[num_accepted])
            continue
        probs = _filter(block, group).softmax(dim=-1)
        index = row.num_output_tokens  # position j's output index: index + j
        uniforms = _streams(device, row.seed, index, k, 0, _ACCEPT_SALT)
        p_draft = probs[:k].gather(1, draft_ids[:, None]).squeeze(1)
        if q is None:
            accept = uniforms < p_draft
        else:
            q = q.to(device=device, dtype=torch.float32)
            accept = uniforms * q.gather(1, draft_ids[:, None]).squeeze(1) < p_draft
        num_accepted = accept.long().cumprod(dim=0).sum()
        if q is not None:  # the residual max(p - q, 0) at each rejectable position; p_k for the bonus
            residual = torch.cat([(probs[:k] - q).clamp(min=0.0), probs[k:]])
            noise = _streams(device, row.seed, index, k + 1, probs.shape[1])
            candidates = torch.where(residual > 0, residual.log() - noise.log(), float("-inf")).argmax(dim=-1)
            accepted.append(num_accepted)
            tokens.append(candidates[num_accepted])
            continue
        # The token at each possible stop: the residual at a rejected position, p_k after all,
        # drawn by an exponential race: argmax of p / E = argmax of log p - log E.
        scores = _filter(block, group)
        scores[torch.arange(k, device=device), draft_ids] = float("-inf")
        noise = _streams(device, row.seed, index, k + 1, probs.shape[1])
        candidates = torch.where(scores == float("-inf"), float("-inf"), scores - noise.log()).argmax(dim=-1)
        accepted.append(num_accepted)
        tokens.append(candidates[num_accepted])
    return torch.stack(accepted), torch.stack(tokens)
