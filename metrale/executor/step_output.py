"""A launched step's result: what the host reads back from the device, and when.

`PendingOutput` copies a step's sampled tokens to the host without blocking, with everything
else the host needs of the step (a verify step's accepted counts and the drafts only the device
held, a runner-side drafter's proposals for the next step) in the same copy, behind the step's
work: a later read of a device tensor would wait for the step launched after this one too
(asynchronous scheduling). `result()` waits for that copy, writes the tokens over the runner's
placeholders, and builds the ModelRunnerOutput.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from metrale.executor.drafters.base import DraftOutput
from metrale.executor.sampler import SampledTokens
from metrale.messages.scheduler_output import PLACEHOLDER, ModelRunnerOutput

if TYPE_CHECKING:
    from metrale.executor.model_runner import ModelRunner


class PendingOutput:
    """A launched step's sampled tokens, copied to the host without blocking. `result()` waits for
    them, writes them over the runner's placeholders, and builds the ModelRunnerOutput."""

    def __init__(self, runner: "ModelRunner", request_ids: list[str], sampled: SampledTokens | None,
                 verified: "VerifiedDrafts | None" = None, drafts: DraftOutput | None = None):
        self.runner, self.request_ids, self.sampled = runner, request_ids, sampled
        self.verified = verified
        self.drafts = drafts  # a runner-side drafter's proposals for the next step, per sampled request
        self._result: ModelRunnerOutput | None = None
        self._host = self._event = None
        if sampled is not None and sampled.tokens.is_cuda:  # the tokens, the accepted counts, drafts: one wait
            # Read in one copy behind this step's work: a later read of a device tensor would wait
            # for the step launched after this one too (asynchronous scheduling).
            parts = self._parts()
            self._host = torch.empty(sum(p.numel() for p in parts), dtype=torch.int64, pin_memory=True)
            offset = 0
            for part in parts:
                self._host[offset:offset + part.numel()].copy_(part.reshape(-1), non_blocking=True)
                offset += part.numel()
            self._event = torch.cuda.Event()
            self._event.record()

    def _parts(self) -> list[torch.Tensor]:
        """What the host reads back: the tokens, the verified parts, the next step's drafts."""
        return ([self.sampled.tokens] + (self.verified.device_parts() if self.verified is not None else [])
                + ([self.drafts.token_ids] if self.drafts is not None else []))

    def _read(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(tokens, accepted counts, device-held drafts flattened, the drafter's proposals
        flattened), waiting for the copy."""
        n = len(self.request_ids)
        if self._event is not None:
            self._event.synchronize()
            values = self._host.tolist()
        else:
            values = [v for part in self._parts() for v in part.reshape(-1).tolist()]
        proposed = self.drafts.token_ids.numel() if self.drafts is not None else 0
        counts = len(self.verified.drafts) if self.verified is not None else 0
        end = len(values) - proposed
        return values[:n], values[n:n + counts], values[n + counts:end], values[end:]

    def result(self) -> ModelRunnerOutput:
        if self._result is not None:
            return self._result
        out = ModelRunnerOutput()
        if self.sampled is not None:
            tokens, counts, device_drafts, proposed = self._read()
            logprobs = self.sampled.logprobs(tokens)
            accepted = self.verified.read(counts, device_drafts) if self.verified is not None else {}
            draft_logprobs = self.sampled.draft_logprobs(
                {i: accepted[rid] + [tokens[i]] for i, rid in enumerate(self.request_ids) if rid in accepted})
            for i, (request_id, token, lp) in enumerate(zip(self.request_ids, tokens, logprobs)):
                new_tokens = [token]
                if request_id in accepted:
                    out.num_accepted_drafts[request_id] = len(accepted[request_id])
                    out.accepted_draft_ids[request_id] = accepted[request_id]
                    new_tokens = accepted[request_id] + [token]
                state = self.runner.requests.get(request_id)
                if state is not None:
                    state.resolve_placeholder(new_tokens)
                out.sampled_token_ids[request_id] = token
                if lp is not None:
                    out.logprobs[request_id] = [lp]
                elif i in draft_logprobs:
                    out.logprobs[request_id] = draft_logprobs[i]
            if self.drafts is not None:
                k = self.drafts.token_ids.shape[1]
                for i, request_id in enumerate(self.request_ids):
                    out.draft_token_ids[request_id] = [t for t in proposed[i * k:(i + 1) * k] if t >= 0]
        self._result = out
        return out


class VerifiedDrafts:
    """A verify step's accepted counts on the device, and each verified request's drafts (in the
    rejection sampler's order). Drafts the scheduler planned as PLACEHOLDERs (proposed on the device
    by the step before) are in `device_drafts`, [len(drafts), k] with -1 past a request's drafts."""

    def __init__(self, drafts: dict[str, list[int]], num_accepted: torch.Tensor,
                 device_drafts: torch.Tensor | None = None):
        self.drafts, self.num_accepted, self.device_drafts = drafts, num_accepted, device_drafts

    def device_parts(self) -> list[torch.Tensor]:
        """What the host reads back: the counts, then the device-held drafts."""
        return [self.num_accepted] + ([self.device_drafts] if self.device_drafts is not None else [])

    def read(self, num_accepted: list[int], device_drafts: list[int]) -> dict[str, list[int]]:
        """Each verified request's accepted drafts, from what was read back to the host."""
        width = len(device_drafts) // max(len(self.drafts), 1)
        out = {}
        for i, ((rid, drafts), n) in enumerate(zip(self.drafts.items(), num_accepted)):
            if PLACEHOLDER in drafts:
                drafts = device_drafts[i * width:i * width + len(drafts)]
            out[rid] = drafts[:n]
        return out
