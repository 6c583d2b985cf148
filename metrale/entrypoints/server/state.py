"""What the route handlers share: the config, the engine, the tokenizer, the drain state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from metrale.engine.async_engine import AsyncEngine, EngineNotReadyError, EngineState
from metrale.messages.errors import EngineDeadError
from metrale.entrypoints.server.args import ServerConfig
from metrale.entrypoints.server.errors import APIError
from metrale.entrypoints.server.metrics import ServerMetrics
from metrale.entrypoints.server.prompts import PromptRenderer
from metrale.multimodal.fetch_policy import MediaFetchPolicy


@dataclass
class ModelInfo:
    """Static facts of the loaded model, read once on the engine thread's behalf at ready time."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's, for unset fields
    created: int = field(default_factory=lambda: int(time.time()))


class Lifecycle:
    """starting -> ready -> draining -> (exit). Counts the HTTP requests in flight."""

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self.drain_deadline: float | None = None
        self.requests_in_flight = 0
        self.exit_code = 0

    def begin_drain(self, timeout: float) -> None:
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + timeout


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    metrics: ServerMetrics
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    prompts: PromptRenderer | None = None
    model: ModelInfo | None = None
    media_policy: MediaFetchPolicy | None = None  # from the flags, checked before the engine starts

    def require_ready(self) -> tuple[PromptRenderer, ModelInfo]:
        if self.engine.state not in (EngineState.LOADING, EngineState.READY):
            raise EngineDeadError(f"the engine is not running ({self.engine.state.value})")
        if self.prompts is None or self.model is None or not self.lifecycle.ready:
            raise EngineNotReadyError("the model is still loading")
        return self.prompts, self.model

    def check_model(self, name: str | None) -> None:
        """A request names the served model or none; anything else is a 404, as OpenAI answers."""
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
