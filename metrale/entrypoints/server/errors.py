"""Every failure leaves the server as OpenAI's error object with a fitting status.

{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}. Validation problems are
400 (never FastAPI's 422), whatever their source: pydantic, the engine's SamplingParams, the
prompt checks in LLMEngine.add_request, the chat template.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrale.engine.async_engine import EngineNotReadyError, EngineOverloadedError, RequestAbortedError
from metrale.messages.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "1"

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPE_OF_STATUS.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def api_error_of(exc: BaseException) -> APIError:
    """The HTTP face of an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, ValueError):  # e.g. the scheduler's "the prompt does not fit in the KV cache"
        return APIError(400, str(exc))
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": RETRY_AFTER_SECONDS})
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc), code="loading", headers={"Retry-After": RETRY_AFTER_SECONDS})
    if isinstance(exc, RequestAbortedError):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    logger.error("internal error: %r", exc, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def _param_of(loc: tuple) -> str | None:
    parts = [p for p in loc if p != "body"]
    # pydantic names union members in the location (e.g. "list[int]"); drop them.
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))]
    if not parts:
        return None
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    return text


def _validation_message(error: dict) -> tuple[str, str | None]:
    if error.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = _param_of(tuple(error.get("loc", ())))
    if param is None and error.get("type") == "missing":
        return "the request body is missing or is not a JSON object", None
    message = error.get("msg", "invalid value")
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message, param = _validation_message(errors[0]) if errors else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code if 400 <= exc.status_code < 600 else 400
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if message == "There was an error parsing the body":  # FastAPI's words for a body json.loads refused
            message = "the request body could not be read: send UTF-8 encoded JSON"
        elif status == 404:
            message = f"no route {request.url.path}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(status, message, headers=getattr(exc, "headers", None))

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        error = api_error_of(exc)
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    for known in (APIError, InvalidRequestError, ValueError, EngineOverloadedError, EngineNotReadyError,
                  RequestAbortedError, EngineDeadError):
        app.add_exception_handler(known, _known)
    # The catch-all runs in Starlette's outermost middleware, which logs the exception too.
    app.add_exception_handler(Exception, _known)
