"""Fault injection for the e2e servers (reliability case 24), through the public LLMEngine
methods only: once a prompt containing a marker was added, the next engine step first runs the
fault. Used by crash_server.py and stall_server.py, which run `met serve` with one installed."""

import sys

from metrale.engine import engine as engine_module


def inject(marker: str, fault) -> None:
    add_request, step = engine_module.LLMEngine.add_request, engine_module.LLMEngine.step

    def add_request_watching(self, request_id, prompt, params, *args, **kwargs):
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str) and marker in text:
            self._fault_armed = True
        return add_request(self, request_id, prompt, params, *args, **kwargs)

    def step_with_fault(self):
        if getattr(self, "_fault_armed", False):
            self._fault_armed = False
            fault()
        return step(self)

    engine_module.LLMEngine.add_request = add_request_watching
    engine_module.LLMEngine.step = step_with_fault


def serve() -> int:
    from metrale.entrypoints.cli import main

    return main(sys.argv[1:])
