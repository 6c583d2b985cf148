"""The offline API, with vLLM's names: LLM(model=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from metrale.config.engine_args import EngineArgs
from metrale.engine.engine import PromptType
from metrale.messages.outputs import RequestOutput
from metrale.messages.sampling_params import SamplingParams
from metrale.startup import build_llm_engine

_PROGRESS_BAR_MIN_PROMPTS = 8


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = build_llm_engine(self.engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # a single prompt of token ids
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
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

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not show_progress) as bar:
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
