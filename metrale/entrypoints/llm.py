"""The offline API, with vLLM's names: LLM(model=...).generate(prompts, sampling_params).

An LLM owns its engine: the devices' memory, and on several ranks the worker processes and the
process groups. They are released when the LLM is closed (`llm.close()`, or leaving a
`with LLM(...) as llm:` block), deleted, garbage-collected, or at interpreter exit, whichever
comes first; a second engine in the same process then starts cleanly.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from metrale.config.engine_args import EngineArgs
from metrale.engine.engine import LLMEngine, PromptType
from metrale.messages.outputs import RequestOutput
from metrale.messages.sampling_params import SamplingParams
from metrale.multimodal.chat_parts import check_modalities, engine_modalities, split_content
from metrale.multimodal.fetch_policy import MediaFetchPolicy
from metrale.multimodal.media_loading import load_media_sync
from metrale.startup import build_llm_engine

_PROGRESS_BAR_MIN_PROMPTS = 8

Conversation = list[dict]


@dataclass(frozen=True)
class Metric:
    """One sample of `LLM.get_metrics()`: the server's /metrics names (met: prefix, vLLM names)."""

    name: str
    kind: str  # "counter" or "gauge"
    value: float
    labels: dict = field(default_factory=dict)


@dataclass
class _Totals:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict = field(default_factory=dict)  # finish reason -> requests


def _release(engine: LLMEngine) -> None:
    engine.shutdown()


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """`kwargs`: EngineArgs fields, or their vLLM names (tensor_parallel_size, ...)."""
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = build_llm_engine(self.engine_args)
        self._ids = itertools.count()
        self._totals = _Totals()
        self._fetch_policy: MediaFetchPolicy | None = None
        # Not a method of self: the finalizer must not keep the LLM alive.
        self._release = weakref.finalize(self, _release, self.llm_engine)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Release the engine's worker ranks and process groups now; the LLM cannot generate after."""
        self._release()

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- vLLM's accessors ----------------------------------------------------------------------

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (--generation-config)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now, by the names GET /metrics uses."""
        stats = self.llm_engine.scheduler.stats()
        totals = self._totals
        metrics = [
            Metric("met:num_requests_running", "gauge", stats.num_running),
            Metric("met:num_requests_waiting", "gauge", stats.num_waiting),
            Metric("met:kv_cache_usage_perc", "gauge", stats.kv_cache_usage),
            Metric("met:num_preemptions_total", "counter", stats.num_preemptions_total),
            Metric("met:prefix_cache_queries_total", "counter", stats.prefix_cache_queries_total),
            Metric("met:prefix_cache_hits_total", "counter", stats.prefix_cache_hits_total),
            Metric("met:prompt_tokens_total", "counter", totals.prompt_tokens),
            Metric("met:generation_tokens_total", "counter", totals.generation_tokens),
        ]
        metrics += [Metric("met:request_success_total", "counter", count, {"finished_reason": reason})
                    for reason, count in sorted(totals.finished.items())]
        spec = stats.spec_decode
        if spec is not None:  # speculative decoding is on
            metrics += [Metric("met:spec_decode_num_drafts_total", "counter", spec.num_drafts),
                        Metric("met:spec_decode_num_draft_tokens_total", "counter", spec.num_draft_tokens),
                        Metric("met:spec_decode_num_accepted_tokens_total", "counter", spec.num_accepted_tokens)]
            metrics += [Metric("met:spec_decode_num_accepted_tokens_per_pos_total", "counter", count,
                               {"position": str(position)})
                        for position, count in enumerate(spec.accepted_per_position)]
        return metrics

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order."""
        if self.closed:
            raise RuntimeError("this LLM was closed")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # a single prompt of token ids
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = str(next(self._ids))
                engine.add_request(request_id, prompt, params.clone(output_kind="final_only"))
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm and len(ids) >= _PROGRESS_BAR_MIN_PROMPTS)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or to several,
        each rendered with the tokenizer's chat template (or `chat_template`). Content may be
        OpenAI's parts: text, image_url (https, data: or file:// URLs under the media fetch policy
        of this LLM's options), video_url, and vLLM's image_pil (a PIL image)."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM runs without one (skip_tokenizer_init)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            rendered, refs = self._split_media(conversation)
            text = tokenizer.apply_chat_template(rendered, tokenize=False, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message)
            if refs:
                # The engine's processor expands each media placeholder from the text.
                prompts.append({"prompt": text, "multi_modal_data": load_media_sync(refs, self._media_policy())})
            else:
                # The template writes any BOS itself: the tokenizer must not add another.
                prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _split_media(self, conversation: Conversation) -> tuple[Conversation, list]:
        """The conversation as its template reads it, and its media (checked against the model)."""
        rendered, refs = [], []
        for i, message in enumerate(conversation):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content, message_refs = split_content(content, f"messages[{i}]", allow_objects=True)
                message = dict(message, content=content)
                refs += message_refs
            rendered.append(message)
        if refs:
            check_modalities(refs, engine_modalities(self.llm_engine), self.engine_args.model or "demo")
        return rendered, refs

    def _media_policy(self) -> MediaFetchPolicy:
        if self._fetch_policy is None:
            self._fetch_policy = MediaFetchPolicy.from_engine_args(self.engine_args)
        return self._fetch_policy

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not show_progress) as bar:
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        self._count(out)
                        bar.update(1)
        return [finished[i] for i in ids]

    def _count(self, out: RequestOutput) -> None:
        totals = self._totals
        totals.prompt_tokens += len(out.prompt_token_ids or [])
        for completion in out.outputs:
            totals.generation_tokens += len(completion.token_ids)
            reason = completion.finish_reason or "abort"
            totals.finished[reason] = totals.finished.get(reason, 0) + 1
