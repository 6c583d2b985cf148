"""Speculative decoding over linear attention: the per-request state after each drafted position
of a verify step (layers/forward_context.py DraftStates), so that the runner can keep the state
of the last accepted position once the rejection sampler has run.

A verify step computes a drafted request's last token and its k drafts (1 + k positions). Every
linear-attention backend writes, for a drafted sequence i,
- the conv window and the recurrent state after position j < k into scratch row
  `state_rows[i, j]` of its state tensors, and
- the states after the last position into the sequence's own slot, as any step does.
The runner then copies row `state_rows[i, a]` into the slot when a < k drafts were accepted
(`keep_accepted_states`, called through executor/cache_tensors.py). Rejected drafts thus never reach a state
that a later step reads, and the prefix cache's checkpoints are never saved in a verify step.

The conv windows are cut here, with torch ops at static shapes ([num_seqs, k]), for every
backend: the window after position j is the last kernel - 1 inputs of the history followed by
the step's inputs 0..j. The recurrent states are written by each backend's delta rule.
"""

from __future__ import annotations

import torch

from metrale.layers.forward_context import DraftStates


def keep_draft_conv_states(x: torch.Tensor, weight_dtype: torch.dtype, conv_state: torch.Tensor,
                           query_start_loc: torch.Tensor, state_slots: torch.Tensor,
                           has_initial_state: torch.Tensor, drafts: DraftStates) -> None:
    """Writes the conv window after each drafted position into the scratch rows; call it before
    the conv overwrites the slots. x [num_tokens, channels] (rows may be strided), conv_state
    [num_slots, channels, kernel - 1] (any strides). The inputs are rounded as the conv rounds
    what it stores (to the weight's dtype, then the state's)."""
    num_seqs, k = drafts.state_rows.shape
    if num_seqs == 0 or k == 0 or x.shape[0] == 0:
        return
    width, channels = conv_state.shape[-1], conv_state.shape[-2]
    steps = torch.arange(k, device=x.device)
    rows = (query_start_loc[:-1].long().unsqueeze(1) + steps).clamp_(max=x.shape[0] - 1)  # [num_seqs, k]
    new = x[rows.flatten()].to(weight_dtype).to(conv_state.dtype).view(num_seqs, k, channels).transpose(1, 2)
    history = conv_state[state_slots.long()] * (has_initial_state != 0).view(-1, 1, 1).to(conv_state.dtype)
    inputs = torch.cat([history, new], dim=-1)  # [num_seqs, channels, width + k]
    # unfold: window s covers inputs[s : s + width]; the one after position j starts at j + 1.
    windows = inputs.unfold(-1, width, 1)[:, :, 1:]  # [num_seqs, channels, k, width]
    conv_state[drafts.state_rows.flatten().long()] = windows.permute(0, 2, 1, 3).reshape(num_seqs * k, channels,
                                                                                         width)


def chunk_redirect(state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                   drafts: DraftStates | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, has_initial_state) for a chunked kernel run over a step that mixes prefill chunks
    and verifies, when a verify kernel computes the drafted sequences afterwards: each drafted
    sequence starts from zeros and ends in its first scratch row (which the verify kernel then
    overwrites), so its own slot keeps the state it started from."""
    if drafts is None:
        return state_slots, has_initial_state
    drafted = drafts.num_drafts > 0
    return (torch.where(drafted, drafts.state_rows[:, 0], state_slots),
            torch.where(drafted, torch.zeros_like(has_initial_state), has_initial_state))


def draft_rows_cpu(drafts: DraftStates | None) -> list[list[int]] | None:
    """Each sequence's scratch rows, one per draft, on the host (the PyTorch references loop on
    the host anyway)."""
    if drafts is None:
        return None
    return [rows[:count] for rows, count in zip(drafts.state_rows.tolist(), drafts.num_drafts.tolist())]


def keep_accepted_states(states: list[torch.Tensor], slots: torch.Tensor, rows: torch.Tensor,
                         num_drafts: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """After a verify step, on the device: slot slots[i] holds the state after its last draft;
    with a_i = num_accepted[i] < num_drafts[i] it takes the state after its last accepted token
    (the position of draft a_i - 1, or the step's first token when a_i = 0) from scratch row
    rows[i, a_i]. Every tensor in `states` ([num_slots, ...] each); no host sync."""
    if not states or slots.numel() == 0:
        return
    accepted = num_accepted.to(device=slots.device, dtype=torch.long)
    picked = rows.long().gather(1, accepted.clamp(max=rows.shape[1] - 1).unsqueeze(1)).squeeze(1)
    slots = slots.long()
    sources = torch.where(accepted < num_drafts.long(), picked, slots)
    for state in states:
        state[slots] = state[sources]
