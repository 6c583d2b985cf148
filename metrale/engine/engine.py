"""LLMEngine: requests in, RequestOutputs out. One step is schedule -> execute -> update."""

from __future__ import annotations

import json
import logging
import os
import random
import time

import torch

from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import ModelConfig, load_model_config
from metrale.engine.errors import InvalidRequestError
from metrale.engine.output_processor import OutputProcessor
from metrale.engine.outputs import RequestOutput
from metrale.engine.request import Request, RequestStatus
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.scheduler import Scheduler
from metrale.executor.kv_cache_sizing import num_kv_blocks
from metrale.executor.model_loader import build_model
from metrale.executor.model_runner import ModelRunner
from metrale.models.registry import supported_architectures

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but PyTorch sees no CUDA device")
    return torch.device(name)


def resolve_model_dir(model: str | None) -> str:
    if model in (None, "demo"):
        from metrale.demo import demo_model_dir

        return demo_model_dir()
    return model


class StartupLog:
    """Prints each startup phase with the time it took."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.number = 0
        self.start = time.perf_counter()

    def phase(self, name: str, detail: str = "") -> None:
        now = time.perf_counter()
        self.number += 1
        if self.enabled:
            logger.info("[%d] %-18s %6.2fs  %s", self.number, name, now - self.start, detail)
        self.start = now


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
    def __init__(self, args: EngineArgs, log_startup: bool = False):
        self.args = args
        log = StartupLog(log_startup)
        self.device = resolve_device(args.device)
        model_dir = resolve_model_dir(args.model)
        log.phase("resolve model", model_dir)

        self.model_config: ModelConfig = load_model_config(model_dir, args.dtype, self.device, args.max_model_len,
                                                           supported_architectures())
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir, trust_remote_code=False)
        self.eos_token_ids = _eos_token_ids(model_dir, self.tokenizer)
        log.phase("read config", f"{self.model_config.architecture}, {self.model_config.dtype}, "
                                 f"context {self.model_config.max_model_len}, device {self.device}")

        torch.manual_seed(args.seed)
        model = build_model(self.model_config, self.device, args.load_format, args.seed, show_progress=log_startup)
        self.runner = ModelRunner(model, self.model_config, self.device, args.block_size, args.attention_backend)
        log.phase("load weights", f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")

        blocks = num_kv_blocks(
            fixed=args.num_kv_blocks, budget_bytes=args.kv_cache_memory,
            bytes_per_block=self.runner.kv_bytes_per_block(), block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_model_len=self.model_config.max_model_len, device=self.device,
            gpu_memory_utilization=args.gpu_memory_utilization)
        self.runner.allocate_kv_cache(blocks)
        self.scheduler = Scheduler(num_kv_blocks=blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_model_len=self.model_config.max_model_len,
                                   enable_prefix_caching=args.enable_prefix_caching)
        log.phase("size KV cache", f"{blocks} blocks x {args.block_size} tokens "
                                   f"({blocks * self.runner.kv_bytes_per_block() / 2**20:.0f} MiB), "
                                   f"attention backend {self.runner.backend.name}")
        self.outputs = OutputProcessor(self.tokenizer)
        self._seed_rng = random.Random(args.seed)
        self._children: dict[str, list[str]] = {}

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

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        params = self.validate_prompt(token_ids, params)
        children = []
        for index in range(params.n):
            # A seeded request with n > 1 gives each completion its own stream: seed + index.
            seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(63)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            children.append(Request(child_id, token_ids, params, seed, arrival_time))
        for child in children:
            self.scheduler.add_request(child)
        self.outputs.add(request_id, text, children)
        self._children[request_id] = [c.request_id for c in children]

    def abort_request(self, request_id: str) -> None:
        for child_id in self._children.pop(request_id, []):
            child = self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            if child is not None:
                self.outputs.finish(child, "abort")
        self.outputs.parents.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        plan, ended = self.scheduler.schedule()
        result = self.runner.execute(plan)
        touched: list[str] = []
        for request in ended:
            self._finish(request, touched)
        for request, new_tokens in self.scheduler.update(plan, result):
            stop = self.outputs.process_tokens(request, new_tokens, result.logprobs.get(request.request_id))
            if stop is not None:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
            if request.is_finished:
                self._finish(request, touched)
            else:
                touched.append(self.outputs.parent_of(request.request_id))
        return [self._output(parent_id) for parent_id in dict.fromkeys(touched)]

    def _finish(self, request: Request, touched: list[str]) -> None:
        parent_id = self.outputs.parent_of(request.request_id)
        if parent_id is None:
            return
        self.outputs.finish(request, request.status.value, request.stop_reason)
        touched.append(parent_id)

    def _output(self, parent_id: str) -> RequestOutput:
        out = self.outputs.output_of(parent_id)
        if out.finished:
            self._children.pop(parent_id, None)
        return out
