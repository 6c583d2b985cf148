"""What the last launched step left on the device for the next one (asynchronous scheduling).

Step N+1 is planned and launched before step N's results are read on the host, so some of its
inputs exist only on the device:

- a token step N sampled: a PLACEHOLDER in the runner's token ids, taken from step N's tokens;
- a draft step N's drafter proposed (MTP, DFlash): a PLACEHOLDER draft in the plan, taken from
  step N's drafts;
- where step N verified drafts, a request planned over it (`CachedRequestData.num_unverified_drafts`)
  has rows laid out as if step N had accepted every draft: its positions, KV slots and sequence
  length move back by the drafts step N rejected.

`LastStep` keeps step N's device tensors. `sources` adds to a step's upload the host arrays that
say which inputs come from them; `fill` fixes the uploaded tensors on the device, with no host
sync. The host's own copies of such a step's sequence lengths are upper bounds
(BatchLayout.seq_len_bounds_cpu).
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.kernels.step_inputs import fill_step_inputs
from metrale.messages.scheduler_output import PLACEHOLDER


class LastStep:
    def __init__(self):
        self.rows: dict[str, int] = {}  # request -> its row among the step's sampled requests
        self.tokens: torch.Tensor | None = None  # int64 [num_sampled]
        self.drafts: torch.Tensor | None = None  # int64 [num_sampled, k]: the drafter's, -1 past a short draft
        self.accepted: torch.Tensor | None = None  # int64 [num_sampled]: drafts accepted, 0 where none verified

    def record(self, request_ids: list[str], tokens: torch.Tensor, accepted: torch.Tensor | None) -> None:
        """A step that sampled for `request_ids` (in order) launched; its drafts come with `record_drafts`."""
        self.rows = {request_id: row for row, request_id in enumerate(request_ids)}
        self.tokens, self.accepted, self.drafts = tokens, accepted, None

    def record_drafts(self, drafts: torch.Tensor) -> None:
        self.drafts = drafts

    def sources(self, request_ids: list[str], seq_index: np.ndarray, query_start: np.ndarray,
                query_lens: np.ndarray, num_drafts: np.ndarray, unverified: np.ndarray,
                input_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The upload's arrays for `fill`: where the step's input ids are PLACEHOLDERs, which of
        the last step's tokens or drafts they are; for the sequences planned over unverified
        drafts, the rows to move back. `num_drafts`: the plan's drafts per sequence (a sequence's
        draft rows are its last ones); `unverified`: CachedRequestData.num_unverified_drafts."""
        out = {}
        holes = np.flatnonzero(input_ids == PLACEHOLDER)
        if holes.size:
            seqs = seq_index[holes]
            last = np.fromiter((self.rows[request_ids[s]] for s in seqs), dtype=np.int64, count=holes.size)
            first_draft = query_start[seqs] + query_lens[seqs] - num_drafts[seqs]
            is_draft = holes >= first_draft
            out["token_holes"], out["token_sources"] = holes[~is_draft], last[~is_draft]
            if is_draft.any():
                k = self.drafts.shape[1]
                out["draft_holes"] = holes[is_draft]
                out["draft_sources"] = last[is_draft] * k + (holes - first_draft)[is_draft]
        moved = np.flatnonzero(unverified)
        if moved.size:
            out["moved_seqs"] = moved
            out["moved_unverified"] = unverified[moved]
            out["moved_last_rows"] = np.fromiter((self.rows[request_ids[s]] for s in moved), dtype=np.int64,
                                                 count=moved.size)
            rows = np.concatenate([np.arange(query_start[s], query_start[s + 1]) for s in moved])
            out["moved_rows"] = rows
            out["moved_row_seqs"] = np.repeat(np.arange(moved.size), query_lens[moved])
        return out

    def fill(self, dev: dict[str, torch.Tensor], block_size: int) -> None:
        """Fix the uploaded inputs (input ids, positions, slots, sequence lengths, as `dev` names
        them) from the last step's tensors, per `sources`' arrays (also in `dev`): one launch on
        CUDA (kernels/step_inputs.py)."""
        sources = {name: dev[name] for name in _SOURCES if name in dev}
        if "token_holes" in sources:
            sources["tokens"] = self.tokens
        if "draft_holes" in sources:
            sources["drafts"] = self.drafts.reshape(-1)
        if "moved_seqs" in sources:
            sources["accepted"] = self.accepted
        fill_step_inputs(dev["input_ids"], dev["positions"], dev["slots"], dev["seq_lens"], dev["tables"], block_size,
                         **sources)


# The upload's arrays `sources` writes, by fill_step_inputs' names.
_SOURCES = ("token_holes", "token_sources", "draft_holes", "draft_sources", "moved_seqs", "moved_unverified",
            "moved_last_rows", "moved_rows", "moved_row_seqs")
