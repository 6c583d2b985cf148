"""The scheduler: fills a token budget each step with decodes and prefill chunks.

There is no prefill or decode phase: every request has `num_computed_tokens` chasing
`num_tokens`, and a step gives each running request (oldest first), then waiting ones (FCFS),
as many tokens as the budget allows. Chunked prefill, decode and recompute after preemption
are the same path. When the KV pool runs dry, the newest running request is preempted: its
blocks (and state slot) go back to the pool and it is recomputed later from the front of the
waiting queue. All cache bookkeeping goes through the coordinator (kv_cache_coordinator.py).

Speculative decoding rides the same path: a running request whose tokens are all known and
computed but the last gets drafts (engine/ngram_drafter.py) and is scheduled 1 + k tokens, with
KV room for all of them. The result rolls num_computed_tokens back by the drafts rejected, so a
rejected token's KV is overwritten later and never becomes part of a cached (hashed) block: the
prefix cache only takes blocks whose tokens are all computed and known. On models with
per-request state the runner keeps the state of the last accepted position (per-draft scratch
slots, layers/linear_attention/draft_states.py), and a verify step never saves a prefix
checkpoint.

Under asynchronous scheduling with a drafter in the runner (MTP, DFlash, and then n-gram too:
`drafts_on_device`), step N+1 is planned while step N, a verify step, is in flight: a request
whose logits nothing edits (`plans_over_drafts`) is scheduled again at once, with 1 + k rows
whose drafts are PLACEHOLDERs (the drafter proposed them in step N, on the device) and a
computed count that assumes step N accepted all its drafts. The runner moves the rows back on
the device by the drafts step N rejected (`CachedRequestData.num_unverified_drafts`), and step
N's result rolls the count back on the host, so both agree once it is read. No torch here.

Media (images, video) ride the same path under an encoder budget per step
(`max_num_encoder_tokens`, encoder output rows): a chunk that reaches an item's span for the
first time (it starts at or before the span's start) spends the item's rows, once per content
hash per step; where the budget is spent the chunk stops before the span and the rest waits for
the next step. A chunk that resumes inside a span (chunked prefill split it) costs nothing: the
runner keeps the item's encoder output (multimodal/encoder_cache.py) while a request still needs
it, and computes any output it does not hold, so the budget bounds a step's encoder work and is
never needed for correctness.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from metrale.engine.kv_cache_coordinator import KVCacheCoordinator
from metrale.engine.ngram_drafter import NgramDrafter
from metrale.engine.request import Request, RequestStatus
from metrale.engine.spec_cost_model import DraftLengthChooser
from metrale.engine.spec_stats import SpecDecodeStats
from metrale.messages.scheduler_output import (PLACEHOLDER, CachedRequestData, ModelRunnerOutput, NewRequestData,
                                             SchedulerOutput)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries_total: int  # prompt tokens looked up
    prefix_cache_hits_total: int  # of those, tokens whose KV was reused
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on


class Scheduler:
    def __init__(self, *, num_kv_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, enable_prefix_caching: bool = False,
                 num_state_slots: int = 0, num_checkpoint_slots: int = 0, drafter: NgramDrafter | None = None,
                 draft_length: DraftLengthChooser | None = None, max_num_encoder_tokens: int | None = None):
        """`num_state_slots`: per-request state slots of a model that keeps state (at least
        max_num_seqs), 0 otherwise; `num_checkpoint_slots`: the prefix cache's state checkpoints;
        `drafter`: speculative decoding's drafter, or None; `draft_length`: the measured cost
        model that picks each step's k (None: the drafter's k every step);
        `max_num_encoder_tokens`: the encoder budget per step (None: max_num_batched_tokens)."""
        if num_state_slots and num_state_slots < max_num_seqs:
            raise ValueError(f"{num_state_slots} state slots cannot hold {max_num_seqs} running sequences")
        self.drafter = drafter
        self.draft_length = draft_length
        self.spec_stats = SpecDecodeStats() if drafter is not None else None
        self.kv = KVCacheCoordinator(num_kv_blocks, block_size, num_state_slots=num_state_slots,
                                     num_checkpoint_slots=num_checkpoint_slots,
                                     enable_prefix_caching=enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_num_encoder_tokens = max_num_encoder_tokens or max_num_batched_tokens
        self._encoder_budget = 0  # this step's rows left
        self._encoded_this_step: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self._dropped_since_last_step: list[str] = []  # finished or preempted: runner forgets them
        self._runner_knows: set[str] = set()
        self.num_preemptions_total = 0
        # Asynchronous scheduling with a runner-side drafter (set by the engine): a request whose
        # verify step is in flight may be planned again, with the drafts that step proposes
        # (plans_over_drafts says which).
        self.drafts_on_device = False

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens > self.kv.capacity_tokens:
            raise ValueError(
                f"the prompt has {request.num_tokens} tokens but the KV cache holds only "
                f"{self.kv.capacity_tokens} ({self.kv.num_blocks} blocks of {self.kv.block_size}); "
                f"raise --num-kv-blocks or --kv-cache-memory, or shorten the prompt")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> Request | None:
        """End a request from outside (abort, stop string). Unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.stop_reason = stop_reason
        self._finish(request, status)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.drop_placeholders()  # the steps that would have computed them are not its concern now
        request.status = status
        self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)
        if request.request_id in self._runner_knows:
            self._runner_knows.discard(request.request_id)
            self._dropped_since_last_step.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id, preempted=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        if request.request_id in self._runner_knows:
            self._runner_knows.discard(request.request_id)
            self._dropped_since_last_step.append(request.request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions_total,
                              self.kv.prefix_queries_total, self.kv.prefix_hits_total,
                              self.spec_stats.copy() if self.spec_stats is not None else None)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> tuple[SchedulerOutput, list[Request]]:
        """Plan one step. Also returns requests that ended while planning (they can never fit)."""
        out = SchedulerOutput(finished_request_ids=self._dropped_since_last_step)
        self._dropped_since_last_step = []
        self.kv.end_step()  # the last plan's copies are queued on the device
        ended: list[Request] = []
        budget = self.max_num_batched_tokens
        self._encoder_budget = self.max_num_encoder_tokens
        self._encoded_this_step = set()
        preempted_this_step = False
        num_drafts = self._drafts_per_request()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._awaits_last_token(request) or (request.drafts_in_flight and not self.plans_over_drafts(request)):
                index += 1  # a verify step in flight: how many tokens it gives is not known yet
                continue
            start = request.num_computed_tokens
            drafts = self._propose(request, budget, num_drafts)
            num_new = (1 + len(drafts) if drafts else
                       self._encoder_cut(request, start, self.kv.chunk_end(
                           request.request_id, start, min(request.num_tokens_if_accepted, start + budget))) - start)
            if num_new <= 0:
                index += 1  # its next media item waits for the next step's encoder budget
                continue
            new_blocks, preempted_others = self._allocate_or_preempt(request, num_new)
            if new_blocks is not None:
                self._spend_encoder(request, start, start + num_new)
            if new_blocks is not None:
                new_blocks += self._lookahead_blocks(request, start + num_new)
            preempted_this_step |= preempted_others
            if new_blocks is None:
                # Nothing left to preempt but the request itself.
                self.running.remove(request)
                if not self.running and not out.num_scheduled_tokens:
                    # Alone and still short: the pool can never hold it. End it, do not spin.
                    request.stop_reason = "kv_cache_full"
                    self._finish(request, RequestStatus.FINISHED_LENGTH)
                    ended.append(request)
                else:
                    self._preempt(request)
                preempted_this_step = True
                break
            out.cached_requests.append(CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens,
                                                         request.num_unverified_drafts))
            if drafts:
                out.draft_token_ids[request.request_id] = drafts
            self._schedule(request, num_new, out, drafts)
            budget -= num_new
            index += 1

        # Admit waiting requests only when the pool is not under pressure: a preemption this
        # step means the running set already needs more than the pool has.
        while (not preempted_this_step and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            if request.drafts_in_flight:
                break  # preempted during its verify step: resumed once that result is in
            admitted = self._admit(request, budget, out)
            if admitted is None:
                if not self.running:
                    # An empty pool cannot hold this chunk: it never will.
                    self.waiting.popleft()
                    request.error = (f"the request needs {request.num_tokens} tokens of KV cache but the "
                                     f"pool holds {self.kv.capacity_tokens}")
                    self._finish(request, RequestStatus.FINISHED_LENGTH if request.num_output_tokens
                                 else RequestStatus.FINISHED_ERROR)
                    ended.append(request)
                    continue
                break
            budget -= admitted
        return out, ended

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Start (or resume) the head of the waiting queue: reuse its cached prefix, take room for
        its first chunk. Returns the tokens scheduled, or None when a pool is short."""
        hit = self.kv.lookup(request)
        max_end = self._encoder_cut(request, hit.num_tokens, min(request.num_tokens, hit.num_tokens + budget))
        if max_end <= hit.num_tokens:
            return None  # its first media item waits for the next step's encoder budget
        admission = self.kv.admit(request, hit, max_end)
        if admission is None:
            return None
        end = admission.end
        self._spend_encoder(request, hit.num_tokens, end)
        out.block_copies += admission.block_copies
        out.state_restores += admission.state_restores
        request.num_computed_tokens = hit.num_tokens
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._runner_knows.add(request.request_id)
        out.new_requests.append(NewRequestData(
            request.request_id, list(request.token_ids), request.num_prompt_tokens, request.sampling_params,
            request.seed, admission.block_table + self._lookahead_blocks(request, end), hit.num_tokens,
            admission.state_slot, *self._media_message(request)))
        self._schedule(request, end - hit.num_tokens, out)
        return end - hit.num_tokens

    @staticmethod
    def _media_message(request: Request) -> tuple:
        """(media items, M-RoPE positions, delta) of NewRequestData: the runner's copy."""
        mm = request.multimodal
        if mm is None:
            return [], None, 0
        positions = mm.mrope_positions.tolist() if mm.mrope_positions is not None and mm.items else None
        return [item.to_message() for item in mm.items], positions, mm.mrope_delta

    def _encoder_cut(self, request: Request, start: int, end: int) -> int:
        """Where a chunk [start, end) ends under what is left of this step's encoder budget: before
        the first media span it reaches fresh whose rows do not fit."""
        left, seen = self._encoder_budget, set(self._encoded_this_step)
        for item in request.media:
            if item.end <= start or item.offset < start:
                continue  # behind the chunk, or resumed inside: its output is the runner's already
            if item.offset >= end:
                break
            if item.content_hash not in seen:
                if item.num_embeds > left:
                    return item.offset
                left -= item.num_embeds
                seen.add(item.content_hash)
        return end

    def _spend_encoder(self, request: Request, start: int, end: int) -> None:
        for item in request.media:
            if start <= item.offset < end and item.content_hash not in self._encoded_this_step:
                self._encoder_budget -= item.num_embeds
                self._encoded_this_step.add(item.content_hash)

    def _schedule(self, request: Request, num_new: int, out: SchedulerOutput, drafts: list[int] = ()) -> None:
        out.num_scheduled_tokens[request.request_id] = num_new
        # A verify step's state includes its drafts until the runner keeps the accepted one: never
        # a checkpoint (its end, past the last known token, is never a checkpoint position anyway),
        # nor while one is in flight (the count is then a guess until it is read).
        if not drafts and not request.drafts_in_flight:
            save = self.kv.save_checkpoint(request, request.num_computed_tokens + num_new)
            if save is not None:
                out.state_saves.append(save)
        self._advance(request, num_new, list(drafts))

    def _advance(self, request: Request, num_new: int, drafts: list[int]) -> None:
        """Computation is counted when planned; a chunk that reaches the end of the sequence
        samples a token, held as a placeholder until the step's result arrives. A verify step's
        count runs past the sequence by its drafts until the result rolls it back."""
        end = request.num_tokens_if_accepted
        request.num_computed_tokens += num_new
        if request.num_computed_tokens >= end + len(drafts):
            request.add_placeholder(drafts)

    def _lookahead_blocks(self, request: Request, end: int) -> list[int]:
        """A runner-side drafter that writes its cache past a step's last position (a chained MTP
        drafter): blocks for those slots when the step reaches the sequence's end and the pool has
        them free (never by preempting; without them the drafter proposes shorter drafts)."""
        if end < request.num_tokens_if_accepted:
            return []  # samples nothing: the drafter proposes nothing for it
        lookahead = getattr(self.drafter, "lookahead_tokens", 0)
        blocks = self.kv.grow(request.request_id, min(end + lookahead, self.max_model_len)) if lookahead else []
        # What the step's drafter proposes for the next step on the device (drafts_on_device):
        # all k where it has KV room for its lookahead, else nothing the scheduler can count on.
        request.device_drafts_ready = getattr(self.drafter, "k", 0) if blocks is not None else 0
        return blocks or []

    def _drafts_per_request(self) -> int:
        """This step's k: the drafter's, or the cost model's pick for the step's batch, the
        running requests and the waiting ones it may admit (0: no drafting this step)."""
        if self.drafter is None:
            return 0
        if self.draft_length is None:
            return self.drafter.k
        return self.draft_length.choose(min(self.max_num_seqs, len(self.running) + len(self.waiting)))

    def _propose(self, request: Request, budget: int, num_drafts: int) -> list[int]:
        """Up to `num_drafts` drafts for a running request at its decode position, within the
        budget and its limits. Requests that follow a grammar are drafted (the runner masks each
        of their verify rows by the grammar's state after the drafts before it); those that want
        logprobs are too, and get one TokenLogprobs per token the verify step gives them. With a
        step in flight that samples for the request (asynchronous scheduling), only drafts on the
        device qualify: PLACEHOLDERs for those its drafter proposes there."""
        unverified = request.num_unverified_drafts
        if (self.drafter is None or num_drafts <= 0
                or request.num_computed_tokens - unverified != request.num_tokens - 1):
            return []
        params = request.sampling_params
        # A verify step gives up to k + 1 tokens: never more than max_tokens or the context allow,
        # whatever the steps in flight accept.
        end = request.num_tokens_if_accepted
        room = min(budget, self.max_model_len - end, num_drafts + 1) - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - unverified - 1)
        if room <= 0:
            return []
        if request.num_pending:
            # The drafter's proposals for the step in flight stand for what it proposes next: where
            # the last ones read were none (prompt lookup found no match), a plain row, not a verify
            # step of drafts likely to be padding (each costs a row; docs/speculative.md).
            if not self.plans_over_drafts(request) or not self._expects_drafts(request):
                return []
            drafts = [PLACEHOLDER] * min(room, request.device_drafts_ready)
        else:
            history = request.runner_drafts if getattr(self.drafter, "runs_in_runner", False) else request.token_ids
            drafts = self.drafter.propose(history, room)
        # Drafts never preempt another request: without free blocks for them, a plain step.
        missing = self.kv.blocks_needed(end + len(drafts)) - len(self.kv.get_block_table(request.request_id))
        return drafts if missing <= self.kv.num_free_blocks else []

    def _expects_drafts(self, request: Request) -> bool:
        """Whether the drafter proposes drafts for the step after the one in flight, by the
        drafter's own rule (engine/runner_drafts.py); a drafter without one: always."""
        expects = getattr(self.drafter, "expects_drafts", None)
        return expects(request) if expects is not None else True

    def plans_over_drafts(self, request: Request) -> bool:
        """Whether the request may be planned while a step verifying its drafts is in flight:
        with drafts on the device, for a request whose logits nothing edits (greedy, or drawn at
        random from streams whose output index the device corrects: executor/model_runner.py's
        index_shift). Penalties and min_tokens read the tokens, a grammar its matcher: such a
        request waits for the result (the engine reads it first)."""
        params = request.sampling_params
        return self.drafts_on_device and not params.changes_logits and params.structured_outputs is None

    def _awaits_last_token(self, request: Request) -> bool:
        """A request whose pending token will be its last (max_tokens or the context length): no
        more steps until that token's result ends it."""
        if not request.num_pending:
            return False
        max_tokens = request.sampling_params.max_tokens
        return ((max_tokens is not None and request.num_output_tokens >= max_tokens)
                or request.num_tokens >= self.max_model_len)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> tuple[list[int] | None, bool]:
        """Blocks for `num_new` more tokens, preempting the newest other requests while short.

        Returns (new block ids or None when only `request` itself is left to preempt, whether
        others were preempted).
        """
        preempted_others = False
        while True:
            new_blocks = self.kv.grow(request.request_id, request.num_computed_tokens + num_new)
            if new_blocks is not None:
                return new_blocks, preempted_others
            victim = self.running[-1]
            if victim is request:
                return None, preempted_others
            self.running.pop()
            self._preempt(victim)
            preempted_others = True

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[tuple[Request, list[int]]]:
        """Apply a step's result. Returns (request, new token ids) for each request that sampled."""
        updates: list[tuple[Request, list[int]]] = []
        for request_id in plan.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            token = result.sampled_token_ids.get(request_id)
            request.runner_drafts = result.draft_token_ids.get(request_id, [])
            request.proposal_missed = request_id in result.draft_token_ids and not request.runner_drafts
            new_tokens = [token]
            if token is not None:
                new_tokens = self._apply_result(request, result, token)
            self.kv.cache_computed(request, min(request.num_computed_tokens, request.num_known_tokens))
            if token is None:
                continue  # a prefill chunk that does not reach the end of the prompt
            for count, new_token in enumerate(new_tokens, start=1):
                status = self._check_stop(request, new_token, len(new_tokens) - count)
                if status is not None:
                    # Tokens after the one that stops it are dropped, as if never sampled, and so
                    # is any step planned after it.
                    request.drop_placeholders()
                    del request.token_ids[request.num_tokens - (len(new_tokens) - count):]
                    updates.append((request, new_tokens[:count]))
                    self.finish_request(request_id, status, request.stop_reason)
                    break
            else:
                updates.append((request, new_tokens))
        return updates

    def _apply_result(self, request: Request, result: ModelRunnerOutput, token: int) -> list[int]:
        """The oldest step in flight's tokens for the request, in place of its placeholder. A
        verify step keeps its accepted drafts and the sampled token and rolls the computed count
        back over the rejected drafts (their KV is stale from now on)."""
        drafts = request.inflight_drafts[0]
        num_accepted = result.num_accepted_drafts.get(request.request_id, 0)
        accepted = result.accepted_draft_ids.get(request.request_id, drafts[:num_accepted])
        request.resolve_placeholder(accepted, token)
        if drafts:
            # Drafts the device held are known now, up to where the drafter's proposal ended
            # (_learn_device_drafts): the padding after it counts as no draft in the metrics.
            proposed = len(drafts) - drafts.count(PLACEHOLDER)
            if proposed:
                self.spec_stats.record(proposed, min(num_accepted, proposed))
                if self.draft_length is not None:
                    self.draft_length.observe(proposed, min(num_accepted, proposed))
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens -= len(drafts) - num_accepted  # a preempted one restarts from 0
        self._learn_device_drafts(request)
        return accepted + [token]

    @staticmethod
    def _learn_device_drafts(request: Request) -> None:
        """The next step in flight verifies drafts the device held (PLACEHOLDERs): they are the
        proposals this result brought (`runner_drafts`: the drafter's, up to where it ended),
        and PLACEHOLDER past them (padding the device verifies all the same)."""
        if request.inflight_drafts and PLACEHOLDER in request.inflight_drafts[0]:
            planned = request.inflight_drafts[0]
            known = request.runner_drafts[:len(planned)]
            planned[:len(known)] = known

    def _check_stop(self, request: Request, token: int, num_after: int = 0) -> RequestStatus | None:
        """Whether `token`, followed by `num_after` more new tokens of this step, ends the request."""
        params = request.sampling_params
        num_out = request.num_known_tokens - num_after - request.num_prompt_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in params.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_known_tokens - num_after >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

