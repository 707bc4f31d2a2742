"""ApiError's Retry-After: whole seconds, rounded up, never 0; absent unless the error says."""

from __future__ import annotations

from services.gateway.errors import ApiError
from shared.messages.common import ErrorInfo


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert ApiError(503, "busy", retry_after=1.2).headers() == {"Retry-After": "2"}
    assert ApiError(429, "slow down", retry_after=0.01).headers() == {"Retry-After": "1"}
    assert ApiError(400, "bad").headers() == {}


def test_retry_after_travels_in_error_info() -> None:
    info = ErrorInfo(status=503, message="queue full", type="server_error", retry_after=3.0)
    e = ApiError.from_info(info)
    assert (e.status, e.type, e.headers()) == (503, "server_error", {"Retry-After": "3"})
