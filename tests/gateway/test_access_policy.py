"""services/gateway/access_policy.py and key_budget.py, without a server."""

from __future__ import annotations

import hashlib

import pytest

from services.gateway.access_policy import (
    BUDGETED_PATHS,
    OPEN_PATHS,
    AccessDenied,
    AccessPolicy,
    Caller,
    Role,
    bearer_token,
    check_content_type,
    check_site,
    keys_problem,
)
from services.gateway.errors import ApiError
from services.gateway.key_budget import KeyBudget
from services.gateway.openapi import OPERATIONS, document

BOTH = AccessPolicy.from_flags("k1, k2", "root")
USERS_ONLY = AccessPolicy.from_flags("k1")
ADMIN_ONLY = AccessPolicy.from_flags("", "root")


def owner(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def denied(policy: AccessPolicy, path: str, authorization: str | None) -> AccessDenied:
    with pytest.raises(AccessDenied) as e:
        policy.authorize(path, policy.identify(authorization))
    return e.value


def test_only_digests_of_the_keys_are_kept() -> None:
    assert BOTH.api_keys == (hashlib.sha256(b"k1").digest(), hashlib.sha256(b"k2").digest())
    assert b"k1" not in repr(BOTH).encode() and "root" not in repr(BOTH)


def test_an_open_server_makes_every_caller_an_admin_and_ignores_placeholder_keys() -> None:
    policy = AccessPolicy()
    assert policy.open
    for authorization in (None, "Bearer EMPTY", "Basic x"):
        who = policy.identify(authorization)
        assert who == Caller(Role.ADMIN, "")
        policy.authorize("/flush_cache", who)


def test_keys_identify_users_and_admins_by_their_digest() -> None:
    assert BOTH.identify("Bearer k2") == Caller(Role.USER, owner("k2"), True)
    assert BOTH.identify("bearer   root ") == Caller(Role.ADMIN, owner("root"), True)
    assert BOTH.identify("Bearer nope") == Caller(Role.ANONYMOUS, "", True)
    assert BOTH.identify(None) == Caller(Role.ANONYMOUS, "", False)


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/get_server_info", "/nope"])
def test_with_api_keys_the_api_needs_a_valid_key(path: str) -> None:
    missing = denied(BOTH, path, None)
    assert missing.status == 401 and "missing key" in missing.message
    assert missing.headers()["WWW-Authenticate"] == "Bearer"
    assert missing.body()["error"]["type"] == "authentication_error"
    wrong = denied(BOTH, path, "Bearer k3")
    assert wrong.status == 401 and "invalid key" in wrong.message
    assert denied(BOTH, path, "Basic azE=").status == 401  # another scheme is no key
    for key in ("k1", "k2", "root"):
        BOTH.authorize(path, BOTH.identify(f"Bearer {key}"))


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/openapi.json"])
def test_probes_and_the_api_description_stay_open(path: str) -> None:
    for policy in (BOTH, USERS_ONLY, ADMIN_ONLY):
        policy.authorize(path, policy.identify(None))


def test_admin_routes_need_the_admin_key() -> None:
    user = denied(BOTH, "/flush_cache", "Bearer k1")
    assert user.status == 403 and "admin key" in user.message
    assert "WWW-Authenticate" not in user.headers()
    assert denied(BOTH, "/flush_cache", None).status == 401
    assert denied(BOTH, "/flush_cache", "Bearer k3").status == 401
    BOTH.authorize("/flush_cache", BOTH.identify("Bearer root"))


def test_api_keys_without_an_admin_key_disable_admin_routes() -> None:
    refusal = denied(USERS_ONLY, "/flush_cache", "Bearer k1")
    assert refusal.status == 403 and "no --admin-api-key" in refusal.message


def test_an_admin_key_alone_leaves_the_api_open_and_guards_admin_routes() -> None:
    anonymous = ADMIN_ONLY.identify("Bearer EMPTY")  # the openai client's placeholder
    assert anonymous == Caller(Role.ANONYMOUS, "", True)
    ADMIN_ONLY.authorize("/v1/chat/completions", anonymous)
    assert denied(ADMIN_ONLY, "/flush_cache", "Bearer EMPTY").status == 401
    ADMIN_ONLY.authorize("/flush_cache", ADMIN_ONLY.identify("Bearer root"))


def test_bearer_tokens() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("BEARER  abc ") == "abc"
    assert bearer_token("Bearer") is None and bearer_token("Bearer   ") is None
    assert bearer_token("Token abc") is None and bearer_token(None) is None


def test_key_flags_are_checked() -> None:
    assert keys_problem("") is None and keys_problem("a,b") is None
    assert keys_problem("a,,b") == "an empty key in the comma-separated list"
    assert keys_problem("a b") is not None and keys_problem("a\x00") is not None


def test_cross_site_browser_requests_are_refused() -> None:
    for site in (None, "same-origin", "same-site", "none"):
        check_site(site)
    with pytest.raises(AccessDenied) as e:
        check_site("cross-site")
    assert e.value.status == 403


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_posts_the_browser_sends_without_preflight_are_415(content_type: str) -> None:
    with pytest.raises(AccessDenied) as e:
        check_content_type("POST", "/v1/completions", content_type, has_body=True)
    assert e.value.status == 415 and e.value.param == "Content-Type"
    assert content_type in e.value.message
    with pytest.raises(AccessDenied):  # an empty body declared as a form too
        check_content_type("POST", "/flush_cache", content_type, has_body=False)


def test_json_posts_bodiless_posts_gets_and_probes_pass() -> None:
    check_content_type("POST", "/generate", "application/json", has_body=True)
    check_content_type("POST", "/generate", "Application/JSON; charset=utf-8", has_body=True)
    check_content_type("POST", "/flush_cache", None, has_body=False)  # curl -X POST
    check_content_type("GET", "/v1/models", "text/plain", has_body=False)
    check_content_type("POST", "/health_generate", "application/octet-stream", has_body=False)
    with pytest.raises(AccessDenied):  # a body with no declared type
        check_content_type("POST", "/generate", None, has_body=True)


def test_the_key_budget_counts_calls_per_key() -> None:
    budget = KeyBudget(2)
    budget.acquire("a")
    budget.acquire("a")
    budget.acquire("b")
    with pytest.raises(ApiError) as e:
        budget.acquire("a")
    assert e.value.status == 429 and e.value.headers() == {"Retry-After": "1"}
    assert e.value.type == "rate_limit_error"
    budget.release("a")
    budget.acquire("a")
    for _ in range(5):
        budget.acquire("")  # anonymous callers have no per-key budget
    budget.release("a")
    budget.release("a")
    budget.release("b")
    assert budget.inflight == {}


def test_a_zero_budget_is_no_limit() -> None:
    budget = KeyBudget(0)
    for _ in range(100):
        budget.acquire("a")
    assert budget.inflight == {}


def test_the_openapi_document_states_the_access_refusals() -> None:
    doc = document()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for op in OPERATIONS:
        described = doc["paths"][op.path][op.method]
        statuses = set(described["responses"])
        guarded = op.path not in OPEN_PATHS
        assert "403" in statuses and ("401" in statuses) == guarded, op.path
        assert ("security" in described) == guarded, op.path
        assert ("415" in statuses) == (guarded and op.method == "post"), op.path
        assert ("429" in statuses) == (op.path in BUDGETED_PATHS), op.path
