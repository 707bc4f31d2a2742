"""OpenAI-style errors: one exception type the handlers raise, one JSON body shape for all."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from shared.messages.common import ErrorInfo

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_FIELD = re.compile(r"(?:missing required|unknown) field `(?P<field>[^`]+)`")


class ApiError(Exception):
    """An error answered to the client as `{"error": {...}}` with HTTP `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or default_type(status)
        self.retry_after = retry_after

    @classmethod
    def from_info(cls, info: ErrorInfo) -> ApiError:
        return cls(info.status, info.message, info.param, info.type, info.retry_after)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.status)

    @property
    def retry_seconds(self) -> int | None:
        """When to retry, in whole seconds (at least 1), as every protocol says it."""
        return None if self.retry_after is None else max(1, math.ceil(self.retry_after))

    def headers(self) -> dict[str, str]:
        """`Retry-After` when the error says when to retry."""
        seconds = self.retry_seconds
        return {} if seconds is None else {"Retry-After": str(seconds)}


def default_type(status: int) -> str:
    if status == 400:
        return "invalid_request_error"
    if status == 404:
        return "not_found_error"
    if status in (503, 429):
        return "service_unavailable"
    if status == 504:
        return "timeout_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, type: str, param: str | None, code: int | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_decode_error(e: msgspec.DecodeError) -> ApiError:
    """A 400 for a body msgspec could not decode; `param` names the offending field.

    "Expected `int`, got `str` - at `$.max_tokens`"          -> param "max_tokens"
    "Object missing required field `role` - at `$.messages[0]`" -> param "messages[0].role"
    """
    if not isinstance(e, msgspec.ValidationError):
        return invalid(f"invalid JSON: {e}")
    message = str(e)
    at = _AT.search(message)
    path = at.group("path").lstrip(".") if at else ""
    field = _FIELD.search(message)
    if field:
        path = f"{path}.{field.group('field')}" if path else field.group("field")
    return invalid(message, path or None)
