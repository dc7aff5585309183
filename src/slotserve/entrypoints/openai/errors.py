"""OpenAI-style errors: the body every failure is answered with, and which status each failure gets."""

from __future__ import annotations

from typing import Any

from slotserve.engine.async_llm import EngineDeadError, RequestAbortedError
from slotserve.tokenizer import TokenizerError


class ServerError(Exception):
    """A failure with its HTTP status, OpenAI error type and, where one field is to blame, that field."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> ServerError:
    return ServerError(400, "BadRequestError", message, param)


def unavailable(message: str) -> ServerError:
    return ServerError(503, "ServiceUnavailableError", message)


def as_server_error(e: Exception) -> ServerError:
    """The status of an exception raised while serving a request. ValueErrors name their field first
    ("max_tokens: ..."), and that field becomes `param`."""
    if isinstance(e, ServerError):
        return e
    if isinstance(e, (ValueError, TokenizerError)):
        message = str(e)
        field, sep, _ = message.partition(":")
        return bad_request(message, field if sep and " " not in field else None)
    if isinstance(e, EngineDeadError):
        return unavailable(f"the engine is not running: {e}")
    if isinstance(e, RequestAbortedError):
        return unavailable(str(e))
    return ServerError(500, "InternalServerError", f"internal error: {type(e).__name__}")
