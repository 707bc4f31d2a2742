"""Who may call what: API keys, the admin key, and the checks that close cross-site requests.

Synchronous and free of aiohttp, so every rule is unit-tested on its own; `access.py` is the
thin middleware that applies it to each request.

Roles, by what the caller's `Authorization: Bearer <key>` matches:
- no key configured at all: the server is open and every caller is an admin (bind it to
  127.0.0.1, the default). Clients' placeholder keys (the openai client always sends one) are
  ignored.
- `--api-key` set: every route but OPEN_PATHS needs one of the keys (401 otherwise).
- `--admin-api-key` set: ADMIN_PATHS, the full /get_server_info and /get_model_info, and
  aborting other callers' requests need it; the admin key also works wherever an API key does.
  Without `--api-key` the API stays open to anonymous callers.
- `--api-key` without `--admin-api-key`: nobody is an admin, and ADMIN_PATHS answer 403.

Only sha256 digests of the keys are kept, compared in constant time. A caller's `owner` is the
hex digest of its key ("" when anonymous): the requests it dispatches are recorded under it, and
it may abort only those (services/gateway/abort_api.py).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass

from services.gateway.errors import ApiError

# Liveness and readiness probes, the static API description and Prometheus's scrapes need
# no key (metrics hold counts and timings, no request's content).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/openapi.json", "/metrics"})
# Routes that change the whole server's state: an admin's only. A new such route must be added.
ADMIN_PATHS = frozenset({"/flush_cache"})
# Routes that start generations: they count against --max-inflight-per-key.
BUDGETED_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate"}
)


class Role(enum.IntEnum):
    ANONYMOUS = 0  # no valid key (allowed only where no --api-key is set)
    USER = 1  # one of --api-key's keys
    ADMIN = 2  # --admin-api-key's key, or anyone on a server with no key at all


@dataclass(frozen=True)
class Caller:
    role: Role
    owner: str  # hex sha256 of the caller's key; "" for anonymous callers and open servers
    presented_key: bool = False  # an Authorization header was sent (for the 401's message)

    @property
    def admin(self) -> bool:
        return self.role is Role.ADMIN


class AccessDenied(ApiError):
    """A 401 carries `WWW-Authenticate: Bearer` (RFC 6750), as OpenAI's API does."""

    def headers(self) -> dict[str, str]:
        extra = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return {**super().headers(), **extra}


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(value: str) -> tuple[bytes, ...]:
    """The digests of a comma-separated list of keys (blanks around commas ignored)."""
    return tuple(digest(k) for k in (part.strip() for part in value.split(",")) if k)


def keys_problem(value: str) -> str | None:
    """A flag check: keys must be non-empty and free of whitespace (they travel in a header)."""
    parts = [part.strip() for part in value.split(",")]
    if value and not all(parts):
        return "an empty key in the comma-separated list"
    if any(any(c.isspace() or not c.isprintable() for c in p) for p in parts):
        return "keys may not contain whitespace or control characters"
    return None


def _matches(found: bytes, keys: tuple[bytes, ...]) -> bool:
    """Whether `found` is one of `keys`, comparing against every one (no early exit)."""
    hit = False
    for key in keys:
        hit |= hmac.compare_digest(found, key)
    return hit


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None when absent or another
    scheme."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


@dataclass(frozen=True)
class AccessPolicy:
    api_keys: tuple[bytes, ...] = ()  # sha256 digests
    admin_keys: tuple[bytes, ...] = ()
    max_inflight_per_key: int = 0  # generation calls in flight per key; 0: no limit

    @classmethod
    def from_flags(
        cls, api_key: str = "", admin_api_key: str = "", max_inflight_per_key: int = 0
    ) -> AccessPolicy:
        return cls(parse_keys(api_key), parse_keys(admin_api_key), max_inflight_per_key)

    @property
    def open(self) -> bool:
        return not self.api_keys and not self.admin_keys

    def identify(self, authorization: str | None) -> Caller:
        """Who is calling; checks nothing about the route (see `authorize`)."""
        if self.open:
            return Caller(Role.ADMIN, "")
        token = bearer_token(authorization)
        presented = authorization is not None
        if token is None:
            return Caller(Role.ANONYMOUS, "", presented)
        found = digest(token)
        if _matches(found, self.admin_keys):
            return Caller(Role.ADMIN, found.hex(), True)
        if _matches(found, self.api_keys):
            return Caller(Role.USER, found.hex(), True)
        return Caller(Role.ANONYMOUS, "", presented)

    def authorize(self, path: str, caller: Caller) -> None:
        """Raise AccessDenied when `caller` may not call `path`: 401 without a valid key where
        one is needed, 403 for a valid key without the admin right an admin route needs."""
        if path in OPEN_PATHS or caller.admin:
            return
        if path in ADMIN_PATHS:
            if caller.role is Role.ANONYMOUS:
                raise self._unauthenticated(caller, admin=True)
            if not self.admin_keys:
                raise AccessDenied(
                    403,
                    f"{path} is disabled: this server has no --admin-api-key",
                    None,
                    "permission_error",
                )
            raise AccessDenied(403, f"{path} needs the admin key", None, "permission_error")
        if self.api_keys and caller.role is Role.ANONYMOUS:
            raise self._unauthenticated(caller, admin=False)

    def _unauthenticated(self, caller: Caller, admin: bool) -> AccessDenied:
        which = "the admin key" if admin else "an API key"
        if caller.presented_key:
            message = f"invalid key: this route needs {which} (Authorization: Bearer <key>)"
        else:
            message = f"missing key: send {which} as Authorization: Bearer <key>"
        return AccessDenied(401, message, None, "authentication_error")


def check_site(sec_fetch_site: str | None) -> None:
    """Browsers say where a request comes from: a page of another site must not drive the API
    with the operator's network position (no CORS is offered, so it could only be a CSRF)."""
    if sec_fetch_site is not None and sec_fetch_site.strip().lower() == "cross-site":
        raise AccessDenied(403, "cross-site browser requests are refused", None, "permission_error")


def check_content_type(method: str, path: str, content_type: str | None, has_body: bool) -> None:
    """A POST's body must be declared `application/json`: the types a page of another site can
    send without a CORS preflight (text/plain, form encodings) are refused. A POST with no body
    and no Content-Type (`curl -X POST .../flush_cache`) carries nothing to misread, and the
    probes of OPEN_PATHS read no body."""
    if method != "POST" or path in OPEN_PATHS or (content_type is None and not has_body):
        return
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        shown = media or "none"
        raise AccessDenied(
            415,
            f"Content-Type must be application/json (got {shown})",
            "Content-Type",
            "invalid_request_error",
        )
