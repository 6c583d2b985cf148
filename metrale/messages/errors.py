"""Errors a caller can act on. `param` names the request field at fault (the API's 400 `param`)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; no request can be served until a restart."""
