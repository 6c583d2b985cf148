"""The scheduler's side of a runner-side drafter (MTP, DFlash: executor/drafters/): drafts the
runner proposed with a step's result (`ModelRunnerOutput.draft_token_ids`), kept on the request
(`Request.runner_drafts`) and verified in its next step. No torch here."""

from __future__ import annotations


class RunnerDrafts:
    """Stands in the scheduler for a drafter that runs in the model runner: `k` is its most drafts
    per step, `lookahead_tokens` the KV slots past a step's last position it writes (reserved
    where the pool has room)."""

    runs_in_runner = True

    def __init__(self, k: int, lookahead_tokens: int = 0):
        self.k, self.lookahead_tokens = k, lookahead_tokens

    def propose(self, runner_drafts: list[int], max_tokens: int) -> list[int]:
        """The runner's drafts of the request's last step, cut to `max_tokens` (the room)."""
        return runner_drafts[:min(self.k, max_tokens)]

    @staticmethod
    def expects_drafts(request) -> bool:
        """Whether drafts are worth planning over the request's step in flight, before its
        proposal is read: by the last proposal read (empty where prompt lookup found no match;
        MTP and DFlash always propose), so a request without a match gets a plain row, not a
        verify step of padding."""
        return not request.proposal_missed
