"""StartupError: the engine cannot start with this model, these options or this machine.

Its message says what is wrong and what to do, in one line; commands print it without a
traceback (`error: ...`, exit status 1) and the server logs it the same way before it exits.
Errors of this kind are raised at startup only, before any request is served.
"""

from __future__ import annotations


class StartupError(Exception):
    """The engine cannot start; the message names the problem and the fix."""


class OptionError(StartupError, ValueError):
    """An option (an `EngineArgs` field or a flag) has a value that cannot work."""
