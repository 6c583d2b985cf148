"""`met serve` whose engine step raises once a prompt containing CRASH_ENGINE was added.

Reliability case 24: the e2e test runs this instead of `met serve` to kill the engine loop from
inside, through the public LLMEngine methods only.
"""

import sys

from metrale.engine import engine as engine_module

_add_request = engine_module.LLMEngine.add_request
_step = engine_module.LLMEngine.step


def add_request(self, request_id, prompt, params, *args, **kwargs):
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if isinstance(text, str) and "CRASH_ENGINE" in text:
        self._crash_requested = True
    return _add_request(self, request_id, prompt, params, *args, **kwargs)


def step(self):
    if getattr(self, "_crash_requested", False):
        raise RuntimeError("injected engine failure")
    return _step(self)


engine_module.LLMEngine.add_request = add_request
engine_module.LLMEngine.step = step

if __name__ == "__main__":
    from metrale.entrypoints.cli import main

    sys.exit(main(sys.argv[1:]))
