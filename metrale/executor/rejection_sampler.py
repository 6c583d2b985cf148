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

This is the PyTorch reference; it runs on the logits' device with no host sync.
"""

from __future__ import annotations

import torch

from metrale.executor.sampler import SamplingRow, _apply_penalties, _filter, stream_seed

# Mixed into the seed of the accept tests' stream, so it is independent of the draws' stream.
_ACCEPT_SALT = 0x5EC0DEC0DE


def position_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The sampling rows of a verify step's 1 + k positions: position j sees drafts[:j] as outputs."""
    return [SamplingRow(row.params, row.seed, row.token_ids + drafts[:j], row.num_prompt_tokens)
            for j in range(len(drafts) + 1)]


def _streams(device, seed: int, first_index: int, count: int, vocab: int, salt: int = 0):
    """Per-position uniforms (one each) or exponential noise (vocab each), one stream per index."""
    out = torch.empty(count, vocab, device=device) if vocab else torch.empty(count, device=device)
    for j in range(count):
        generator = torch.Generator(device=device)
        generator.manual_seed(stream_seed(seed ^ salt, first_index + j))
        if vocab:
            out[j].exponential_(generator=generator)
        else:
            out[j:j + 1].uniform_(generator=generator)
    return out


def verify_drafts(logits: torch.Tensor, rows: list[SamplingRow],
                  drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [sum(1 + len(d) for d in drafts), vocab], each request's positions in order.
    Returns (number of drafts accepted, the token after them), int64 [len(rows)] each, on the
    logits' device."""
    device = logits.device
    position_of = [position_rows(row, d) for row, d in zip(rows, drafts)]
    flat = [r for group in position_of for r in group]
    logits = logits.to(torch.float32, copy=True)
    if any(r.params.changes_logits for r in flat):
        _apply_penalties(logits, flat)
    accepted, tokens = [], []
    start = 0
    for row, draft, group in zip(rows, drafts, position_of):
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
        accept = uniforms < probs[:k].gather(1, draft_ids[:, None]).squeeze(1)
        num_accepted = accept.long().cumprod(dim=0).sum()
        # The token at each possible stop: the residual at a rejected position, p_k after all.
        residual = probs.clone()
        residual[torch.arange(k, device=device), draft_ids] = 0.0
        noise = _streams(device, row.seed, index, k + 1, probs.shape[1])
        candidates = (residual / noise).argmax(dim=-1)  # exponential race: a draw from residual / sum
        accepted.append(num_accepted)
        tokens.append(candidates[num_accepted])
    return torch.stack(accepted), torch.stack(tokens)
