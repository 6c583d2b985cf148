"""The index arrays a step's speculative work reads on the device, built on the host with the step's
layout and carried in its one upload (ModelRunner._upload).

A verify step splits its sampled requests into drafted and plain ones, a runner-side drafter
reads rows and sequences of the step, and each of those picks rows of a device tensor. Indexing a
device tensor with a Python list copies the list from pageable memory, which waits for the
device: under asynchronous scheduling that wait would stall the host in the middle of launching
the next step. So every such list is known here, before the upload, and used on the device as a
view of it (`BatchInputs.index`).
"""

from __future__ import annotations

import numpy as np

from metrale.messages.scheduler_output import PLACEHOLDER


def speculative_indices(sampled_seqs: np.ndarray, logits_indices: np.ndarray, logits_rows: list[range] | None,
                        num_drafts: np.ndarray, num_rows: int, query_start: np.ndarray,
                        chunk_next_ids: np.ndarray | None, capacity: np.ndarray | None) -> dict[str, np.ndarray]:
    """int64 arrays, by name:

    - sampled_seqs: each sampled request's sequence in the batch (batch order);
    - first_rows: the input row of each sampled request's first sampled position (its last
      known token; a plain request's only one);
    - spec_positions / plain_positions: the drafted and the plain requests among the sampled ones;
    - spec_logit_rows / plain_logit_rows: their rows of the step's logits (a drafted request's
      1 + k, a plain one's 1), in order;
    - draft_index [drafted, most drafts]: the input row of each draft, num_rows past a request's
      drafts (a row to read as -1);
    with a drafter in the runner (`chunk_next_ids`, `capacity` given):
    - sampled_capacity: the KV room in tokens of each sampled request's sequence;
    - known_rows / known_next: the last row of each chunk that stops short of its sequence's end,
      and the prompt token after it.
    """
    out = {"sampled_seqs": sampled_seqs}
    drafts = num_drafts[sampled_seqs]
    spec = np.flatnonzero(drafts)
    plain = np.flatnonzero(drafts == 0)
    firsts = np.fromiter((r.start for r in logits_rows), dtype=np.int64, count=len(logits_rows)) \
        if logits_rows is not None else np.arange(len(sampled_seqs))
    out["first_rows"] = logits_indices[firsts]
    if logits_rows is not None:
        out["spec_positions"], out["plain_positions"] = spec, plain
        out["plain_logit_rows"] = firsts[plain]
        out["spec_logit_rows"] = np.concatenate([np.arange(logits_rows[i].start, logits_rows[i].stop) for i in spec]) \
            if spec.size else np.zeros(0, dtype=np.int64)
        width = int(drafts.max()) if spec.size else 0
        index = np.full((spec.size, width), num_rows, dtype=np.int64)
        for r, i in enumerate(spec):
            index[r, :drafts[i]] = logits_indices[firsts[i] + 1:firsts[i] + 1 + drafts[i]]
        out["draft_index"] = index
    if chunk_next_ids is not None:
        out["sampled_capacity"] = capacity[sampled_seqs]
        known = np.flatnonzero(chunk_next_ids != PLACEHOLDER)  # chunks that stop short of the end
        out["known_rows"], out["known_next"] = query_start[1:][known] - 1, chunk_next_ids[known]
    return out
