"""LLMEngine: requests in, RequestOutputs out. One step is schedule -> execute -> update."""

from __future__ import annotations

import json
import logging
import os
import random

from metrale.config.engine_args import EngineArgs
from metrale.config.generation_config import sampling_defaults
from metrale.config.model_config import ModelConfig
from metrale.messages.errors import InvalidRequestError
from metrale.engine.output_processor import OutputProcessor
from metrale.messages.outputs import RequestOutput
from metrale.engine.request import Request, RequestStatus
from metrale.messages.sampling_params import SamplingParams
from metrale.engine.scheduler import Scheduler
from metrale.engine.ngram_drafter import NgramDrafter
from metrale.engine.runner_drafts import RunnerDrafts
from metrale.engine.spec_cost_model import CostTable, DraftLengthChooser
from metrale.models.registry import get_model_class
from metrale.multimodal.processor import MultiModalProcessor, refuse_media

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


def _eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    ids: set[int] = set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class LLMEngine:
    def __init__(self, args: EngineArgs, parts, startup_log=None):
        """`parts`: what startup built (metrale.startup.EngineParts): config, tokenizer, runner,
        memory plan and executor."""
        self.args = args
        # Kept so that `met serve` can log its "ready" phase in the same numbering.
        self.startup_log = startup_log
        self.model_config: ModelConfig = parts.model_config
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner  # this rank's ModelRunner (model, KV cache, memory numbers)
        self.executor = parts.executor  # runs each step: the runner, or the runner and the worker ranks
        self.device = self.runner.device
        self.memory_plan = parts.plan
        self.eos_token_ids = _eos_token_ids(self.model_config.model_dir, self.tokenizer)
        # What a request leaves unset, from generation_config.json (--generation-config).
        self.sampling_defaults = sampling_defaults(self.model_config.model_dir, args.generation_config)
        if self.sampling_defaults:
            logger.info("sampling defaults from generation_config.json, for fields a request leaves unset: %s "
                        "(--generation-config vllm turns them off)",
                        ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items()))
        self.mm_processor = self._mm_processor(args)
        # The model takes images and video (the server and LLM.chat refuse media parts otherwise).
        self.supports_multimodal = self.mm_processor is not None
        self.scheduler = Scheduler(num_kv_blocks=parts.plan.num_kv_blocks, block_size=args.block_size,
                                   max_num_seqs=parts.max_num_seqs,
                                   max_num_batched_tokens=args.step_token_budget(self.device.type),
                                   max_model_len=self.model_config.max_model_len,
                                   enable_prefix_caching=args.enable_prefix_caching,
                                   num_state_slots=parts.plan.max_num_seqs if parts.plan.state_bytes_per_slot else 0,
                                   num_checkpoint_slots=parts.plan.num_checkpoint_slots,
                                   drafter=self._drafter(args),
                                   draft_length=self._draft_length(args, parts.max_num_seqs),
                                   max_num_encoder_tokens=self.max_num_encoder_tokens)
        self.outputs = OutputProcessor(self.tokenizer)
        # The launched step whose result is not applied yet (asynchronous scheduling only).
        self._inflight = None
        self.async_scheduling = self._resolve_async_scheduling(args.async_scheduling)
        # A runner-side drafter's drafts stay on the device: requests are planned over their verify
        # step in flight (scheduler.plans_over_drafts says which).
        self.scheduler.drafts_on_device = self.async_scheduling and getattr(self.scheduler.drafter, "runs_in_runner",
                                                                            False)
        logger.info("scheduling: %s", "asynchronous (step N+1 is launched before step N's tokens are read)"
                    if self.async_scheduling else "synchronous")
        self._seed_rng = random.Random(args.seed)
        self._children: dict[str, list[str]] = {}

    def _mm_processor(self, args: EngineArgs) -> MultiModalProcessor | None:
        """The media processor of a vision-language model (None for a text model), and the encoder
        budget: --max-num-encoder-tokens, or the step's token budget and at least the largest
        image's tokens; the runner's encoder cache holds as many rows."""
        self.max_num_encoder_tokens = None
        model_class = get_model_class(self.model_config.architecture)
        if not getattr(model_class, "supports_multimodal", False):
            return None
        processor = MultiModalProcessor(self.model_config.model_dir, model_class, self.runner.model.vl_config,
                                        limits=args.media_limits, defaults=args.processor_defaults,
                                        vision_max_pixels=args.vision_max_pixels, tokenizer=self.tokenizer)
        budget = args.max_num_encoder_tokens or max(args.step_token_budget(self.device.type),
                                                    processor.max_image_tokens())
        processor.max_item_tokens = self.max_num_encoder_tokens = budget
        self.runner.encoder_cache.capacity_rows = budget
        logger.info("media: encoder budget %d rows per step (--max-num-encoder-tokens), per prompt at most %s",
                    budget, ", ".join(f"{n} {m}(s)" for m, n in processor.limits.items()))
        return processor

    def process_media(self, prompt: PromptType, token_ids: list[int]):
        """The prompt's MultiModalInputs, or None without media; refuses media a text model gets."""
        if not isinstance(prompt, dict):
            return None
        data = prompt.get("multi_modal_data")
        kwargs = prompt.get("mm_processor_kwargs")
        if not data:
            if kwargs and self.mm_processor is None:
                raise InvalidRequestError(f"model {self.model_config.architecture} does not take media: "
                                          "mm_processor_kwargs has nothing to apply to", "mm_processor_kwargs")
            return None
        if self.mm_processor is None:
            refuse_media(self.model_config.architecture, data)
        return self.mm_processor.process(token_ids, data, kwargs)

    def _drafter(self, args: EngineArgs) -> NgramDrafter | RunnerDrafts | None:
        """The scheduler's drafter: n-gram, or the stand-in of the runner's (MTP, DFlash)."""
        spec = args.speculative_decoding
        if spec is None:
            return None
        in_runner = getattr(self.runner, "drafter", None)
        if in_runner is not None:
            logger.info("speculative decoding: drafts proposed in the model runner (%s)", in_runner.describe())
            return RunnerDrafts(in_runner.k, in_runner.lookahead_tokens)
        logger.info("speculative decoding: %s drafts of up to %d tokens (prompt lookup n = %d..%d)", spec.method,
                    spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _draft_length(self, args: EngineArgs, max_num_seqs: int) -> DraftLengthChooser | None:
        """--spec-cost-model measured: the chooser of each step's k over the calibration table,
        once the table is checked to be this drafter's, this target's and this device's."""
        spec = args.speculative_decoding
        if spec is None or spec.cost_model == "static":
            return None
        from metrale.engine.spec_cost_identity import setup_identity

        try:
            table = CostTable.load(spec.cost_calibration)
            table.check_identity(setup_identity(args, self.model_config, self.device, self.runner.model, spec,
                                                getattr(self.runner, "drafter", None)), spec.cost_calibration)
            chooser = DraftLengthChooser(table, spec.num_speculative_tokens)
        except Exception:
            self.executor.shutdown()  # the worker ranks, started already, would outlive the refusal
            raise
        for name, ours in (("num_speculative_tokens", spec.num_speculative_tokens),
                           ("max_num_seqs", max_num_seqs)):
            theirs = table.recorded.get(name)
            if theirs is not None and theirs != ours:
                # The CUDA graphs a step replays follow from these: the times may not be this engine's.
                logger.warning("the spec-cost table %s was measured with %s %s, this engine runs %s: its step "
                               "times may not be this engine's", spec.cost_calibration, name, theirs, ours)
        logger.info("speculative decoding: k per step from the measured cost table %s (batch sizes %d..%d, "
                    "k in %s)", spec.cost_calibration, table.batch_sizes[0], table.batch_sizes[-1],
                    list(table.num_drafts))
        return chooser

    def _resolve_async_scheduling(self, asked: bool | None) -> bool:
        """On by default where it pays: on a CUDA device the host plans step N+1 while the GPU
        runs step N; on the CPU the host is the device, and there is nothing to overlap. With
        speculative decoding, only for a drafter in the runner, whose drafts stay on the device
        (startup puts the n-gram drafter there too when scheduling asynchronously); a drafter on
        the host proposes from a request's real last tokens, which a step in flight has not given."""
        drafter = self.scheduler.drafter
        if drafter is not None and not getattr(drafter, "runs_in_runner", False):
            if asked:
                logger.warning("this engine's drafter proposes on the host, from the tokens of the step before, "
                               "so speculative decoding runs its steps synchronously; --async-scheduling is ignored")
            return False
        if not self.executor.supports_async:
            if asked:
                logger.warning("this executor cannot launch a step before reading the previous one; "
                               "steps run synchronously")
            return False
        return self.args.schedules_asynchronously(self.device.type)

    # -- requests ------------------------------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("the tokenizer is not loaded (skip_tokenizer_init): pass token ids",
                                          "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}",
                                  "prompt")

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check the prompt against the model; returns params with max_tokens resolved."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in 0..{vocab - 1}", "prompt")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias keys must be token ids in 0..{vocab - 1}", "logit_bias")
        limit = self.model_config.max_model_len
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, limit - len(token_ids))
        if len(token_ids) + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the messages, {max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.", "max_tokens")
        return params.clone(max_tokens=max_tokens, eos_token_ids=self.eos_token_ids)

    @property
    def grammars(self):
        """The compiled grammars of structured outputs (structured.GrammarCache), or None
        without a tokenizer. Thread-safe: the server compiles through it off the engine thread."""
        return self.runner.grammars

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        multimodal = self.process_media(prompt, token_ids)
        if multimodal is not None:
            token_ids = multimodal.token_ids  # each placeholder expanded to its item's tokens
        params = self.validate_prompt(token_ids, params)
        if params.structured_outputs is not None:
            self._compile_grammar(params)
        children = []
        for index in range(params.n):
            # A seeded request with n > 1 gives each completion its own stream: seed + index.
            seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(63)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            children.append(Request(child_id, token_ids, params, seed, arrival_time, multimodal=multimodal))
        for child in children:
            self.scheduler.add_request(child)
        self.outputs.add(request_id, text, children)
        self._children[request_id] = [c.request_id for c in children]

    def _compile_grammar(self, params: SamplingParams) -> None:
        """Refuse a grammar that does not compile (InvalidRequestError) before anything is queued.
        The server compiled it already, off this thread; offline, this waits for the compile."""
        if self.grammars is None:
            raise InvalidRequestError("structured outputs need the tokenizer, and this engine runs without one "
                                      "(skip_tokenizer_init)", "structured_outputs")
        self.grammars.compile(params.structured_outputs)

    def abort_request(self, request_id: str) -> None:
        for child_id in self._children.pop(request_id, []):
            child = self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            if child is not None:
                self.outputs.finish(child, "abort")
        self.outputs.parents.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    def shutdown(self) -> None:
        """Stop the worker ranks of a multi-rank engine (a no-op on one rank); no step after it."""
        self.executor.shutdown()

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update. With asynchronous scheduling, step N is launched before
        step N-1's tokens are read back and applied, so the host plans while the device works; a
        step that gives most of its requests their first token is read in the call that launched
        it (`_first_tokens_lead`), so a first token never waits for the next step's launch."""
        touched: list[str] = []
        if self._inflight is not None and self._must_read_before_planning(self._inflight[0]):
            self._complete(*self._inflight, touched)
            self._inflight = None
        plan, ended = self.scheduler.schedule()
        for request in ended:
            self._finish(request, touched)
        if self._inflight is not None and self._needs_real_tokens(plan):
            self._complete(*self._inflight, touched)
            self._inflight = None
        read_at_once = not self.async_scheduling or plan.is_empty or self._first_tokens_lead(plan)
        pending = self.executor.execute_async(plan)
        if self._inflight is not None:
            self._complete(*self._inflight, touched)
        self._inflight = None
        if read_at_once:
            self._complete(plan, pending, touched)
        else:
            self._inflight = (plan, pending)
        outputs = (self._output(parent_id) for parent_id in dict.fromkeys(touched))
        return [out for out in outputs if out is not None]

    def _first_tokens_lead(self, plan) -> bool:
        """Whether at least half of the requests this step samples for get their FIRST token
        from it (their prefill ends here). Such a step is read as soon as its device work ends,
        in the call that launched it, as the synchronous engine does: left in flight, its first
        tokens would wait for the next call to schedule and launch the following step (a whole
        step on the CPU, where launching is computing). The following step then starts after the
        host has planned it, once per such step: at most as many requests lose the overlap for
        one step as get their first token earlier, and steps of decodes keep it."""
        counts = plan.num_scheduled_tokens
        if not plan.new_requests and plan.total_num_scheduled_tokens == len(counts):
            return False  # one token per running request, none admitted: decodes (or a one-token last chunk)
        requests = self.scheduler.requests
        num_sampled = num_first = 0
        for request_id in counts:
            request = requests.get(request_id)
            if request is None or not request.num_pending:
                continue  # a prefill chunk short of the prompt's end samples nothing
            num_sampled += 1
            num_first += request.num_pending == 1 and request.num_known_tokens == request.num_prompt_tokens
        return num_first > 0 and 2 * num_first >= num_sampled

    def _must_read_before_planning(self, inflight_plan) -> bool:
        """Whether the step in flight verifies drafts of a request that cannot be planned before
        its result is read (scheduler.plans_over_drafts): read it first, so that such a request
        is planned this step, from its real tokens, rather than every other step."""
        requests = self.scheduler.requests
        return any(rid in requests and not self.scheduler.plans_over_drafts(requests[rid])
                   for rid in inflight_plan.draft_token_ids)

    def _needs_real_tokens(self, plan) -> bool:
        """Penalties read the previous tokens' values, and a grammar's token bitmask follows from
        them: such a step waits for the one in flight (a batch with any constrained request runs
        synchronously)."""
        requests = self.scheduler.requests
        return any(requests[rid].sampling_params.has_penalties or requests[rid].sampling_params.structured_outputs
                   for rid in plan.num_scheduled_tokens if rid in requests)

    def _complete(self, plan, pending, touched: list[str]) -> None:
        result = pending.result()
        for request, new_tokens in self.scheduler.update(plan, result):
            # One token at a time: a stop string that a verify step's first token completes ends
            # the output there, as it would without speculation.
            logprobs = result.logprobs.get(request.request_id)
            for i, token in enumerate(new_tokens):
                stop = self.outputs.process_tokens(request, [token], logprobs[i] if logprobs else None)
                if stop is not None:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
                    break
            if request.is_finished:
                self._finish(request, touched)
            else:
                touched.append(self.outputs.parent_of(request.request_id))

    def _finish(self, request: Request, touched: list[str]) -> None:
        parent_id = self.outputs.parent_of(request.request_id)
        if parent_id is None:
            return
        self.outputs.finish(request, request.status.value, request.stop_reason)
        touched.append(parent_id)

    def _output(self, parent_id: str) -> RequestOutput | None:
        out = self.outputs.output_of(parent_id)
        if out is not None and out.finished:
            self._children.pop(parent_id, None)
        return out
