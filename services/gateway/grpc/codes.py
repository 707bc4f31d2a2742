"""HTTP statuses -> gRPC status codes, so a refusal reads the same on both protocols.

The message is the HTTP error's own (it names the field: `param`); a retry hint travels as
`retry-after` trailing metadata (whole seconds, as the HTTP header), and the field as
`error-param`.
"""

from __future__ import annotations

import grpc

from services.gateway.errors import ApiError

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    412: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_code(http_status: int) -> grpc.StatusCode:
    if http_status in _CODES:
        return _CODES[http_status]
    return grpc.StatusCode.INVALID_ARGUMENT if http_status < 500 else grpc.StatusCode.INTERNAL


def trailers(e: ApiError) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    if e.retry_seconds is not None:
        out.append(("retry-after", str(e.retry_seconds)))
    if e.param:
        out.append(("error-param", e.param))
    return tuple(out)


def message(e: ApiError) -> str:
    """The HTTP error's message, with the field it names when the message does not."""
    if e.param and e.param not in e.message:
        return f"{e.param}: {e.message}"
    return e.message
