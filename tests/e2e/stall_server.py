"""`met serve` whose engine step hangs for STALL_SECONDS once a prompt containing STALL_ENGINE was
added (reliability case 24: a stalled scheduler), through the public LLMEngine methods only."""

import sys
import time

from metrale.engine import engine as engine_module

STALL_SECONDS = 4.0
_add_request = engine_module.LLMEngine.add_request
_step = engine_module.LLMEngine.step


def add_request(self, request_id, prompt, params, *args, **kwargs):
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if isinstance(text, str) and "STALL_ENGINE" in text:
        self._stall_requested = True
    return _add_request(self, request_id, prompt, params, *args, **kwargs)


def step(self):
    if getattr(self, "_stall_requested", False):
        self._stall_requested = False
        time.sleep(STALL_SECONDS)
    return _step(self)


engine_module.LLMEngine.add_request = add_request
engine_module.LLMEngine.step = step

if __name__ == "__main__":
    from metrale.entrypoints.cli import main

    sys.exit(main(sys.argv[1:]))
