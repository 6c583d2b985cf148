"""StartupError: the engine cannot start with this model, these options or this machine.

Its message says what is wrong and what to do, in one line; commands print it without a
traceback (`error: ...`, exit status 1) and the server logs it the same way before it exits,
unless `--debug` asked for tracebacks. Errors of this kind are raised at startup only, before
any request is served.
"""

from __future__ import annotations


class StartupError(Exception):
    """The engine cannot start; the message names the problem and the fix."""


class ModelLoadError(StartupError, ValueError):
    """The checkpoint cannot be used; the message names the problem."""


class OptionError(StartupError, ValueError):
    """An option (an `EngineArgs` field or a flag) has a value that cannot work."""


_tracebacks = False


def show_tracebacks(on: bool = True) -> None:
    """--debug: print the traceback of every startup error."""
    global _tracebacks
    _tracebacks = on


def wants_traceback(error: BaseException) -> bool:
    """Whether a startup failure is worth its traceback: a bug is, a StartupError is not (its
    message is the whole story), unless --debug."""
    return _tracebacks or not isinstance(error, (StartupError, OSError, ValueError))
