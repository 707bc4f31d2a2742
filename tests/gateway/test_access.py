"""The access middleware through the real gateway app, against the fake backend: keys, admin
routes, owners' aborts, Content-Type, cross-site requests and the per-key budget."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.gateway.access_policy import AccessPolicy
from shared import constants
from shared.messages.heartbeat import ModelInfo
from shared.service import Service
from tests.gateway.fake_backend import FakeBackend, client_rid
from tests.gateway.helpers import MODEL, Running, read_sse, wait_until

pytestmark = pytest.mark.redis

KEYS = AccessPolicy.from_flags("alice-key,bob-key", "admin-key", max_inflight_per_key=1)
ALICE = {"Authorization": "Bearer alice-key"}
BOB = {"Authorization": "Bearer bob-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
HANG = {"text": "hang", "stream": True}


@pytest.fixture
async def keyed(start_gateway: Callable[..., Awaitable[Running]]) -> Running:
    return await start_gateway(access=KEYS)


async def post(http: Any, url: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def hanging(http: Any, gw: Running, rid: str, headers: dict[str, str]) -> Any:
    """A streaming request the fake backend never finishes, once its first event arrived."""
    r = await http.post(f"{gw.url}/generate", json={**HANG, "rid": rid}, headers=headers)
    assert r.status == 200, await r.text()
    await r.content.readuntil(b"\n\n")
    return r


async def test_the_api_needs_a_key_and_probes_do_not(
    keyed: Running, backend: FakeBackend, http
) -> None:
    url = f"{keyed.url}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 3}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic YQ=="}):
        async with http.post(url, json=body, headers=headers) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            error = (await r.json())["error"]
        assert error["code"] == 401 and error["type"] == "authentication_error"
    async with http.get(f"{keyed.url}/v1/models") as r:
        assert r.status == 401
    assert backend.requests == []  # nothing unauthenticated reached the bus
    status, answer = await post(http, url, body, ALICE)
    assert status == 200 and answer["choices"][0]["text"] == "Hello world!"
    async with http.get(f"{keyed.url}/health_generate") as r:
        assert r.status == 200
    async with http.get(f"{keyed.url}/openapi.json") as r:
        assert r.status == 200


async def test_admin_routes_need_the_admin_key(keyed: Running, http) -> None:
    status, error = await post(http, f"{keyed.url}/flush_cache", {}, ALICE)
    assert status == 403 and "admin key" in error["error"]["message"]
    async with http.post(f"{keyed.url}/flush_cache") as r:  # no key, no body
        assert r.status == 401
    # The admin passes: the fake backend has no executor, so the flush itself is refused.
    status, error = await post(http, f"{keyed.url}/flush_cache", {}, ADMIN)
    assert status == 503 and error["error"]["message"] == "no executor is alive"


async def test_text_plain_and_cross_site_posts_are_refused(
    gw: Running, backend: FakeBackend, http
) -> None:
    body = json.dumps({"text": "hi"})
    async with http.post(
        f"{gw.url}/generate", data=body, headers={"Content-Type": "text/plain"}
    ) as r:
        assert r.status == 415
        assert (await r.json())["error"]["param"] == "Content-Type"
    cross = {"Sec-Fetch-Site": "cross-site"}
    async with http.post(f"{gw.url}/abort_request", json={"abort_all": True}, headers=cross) as r:
        assert r.status == 403
    async with http.post(
        f"{gw.url}/flush_cache", data=b"", headers={"Content-Type": "text/plain"}
    ) as r:
        assert r.status == 415
    assert backend.requests == []


async def test_callers_abort_only_their_own_requests(
    start_gateway: Callable[..., Awaitable[Running]],
    backend: FakeBackend,
    aredis: aioredis.Redis,
    http,
) -> None:
    gw, other = await start_gateway(access=KEYS), await start_gateway(access=KEYS)
    alice = await hanging(http, gw, "alice-1", ALICE)
    assert await aredis.exists(constants.rid_key("alice-1"))
    unknown = await post(http, f"{gw.url}/abort_request", {"rid": "nobody-1"}, BOB)
    for target in (gw, other):  # here, and through the registry from another gateway
        refused = await post(http, f"{target.url}/abort_request", {"rid": "alice-1"}, BOB)
        assert refused[0] == 404 == unknown[0]  # the same answer as for a rid nobody has
        message = refused[1]["error"]["message"]
        assert message == unknown[1]["error"]["message"].replace("nobody-1", "alice-1")
    assert await post(http, f"{gw.url}/abort_request", {"abort_all": True}, BOB) == (
        200,
        {"aborted": []},
    )
    assert backend.aborts == []
    status, answer = await post(http, f"{other.url}/abort_request", {"rid": "alice-1"}, ALICE)
    assert (status, answer) == (200, {"aborted": ["alice-1"]})
    assert (await backend.wait_for_abort("alice-1")).reason == "abort_request"
    alice.close()


async def test_abort_all_without_the_admin_key_aborts_only_the_callers_requests(
    keyed: Running, backend: FakeBackend, http
) -> None:
    alice = await hanging(http, keyed, "alice-2", ALICE)
    bob = await hanging(http, keyed, "bob-2", BOB)
    url = f"{keyed.url}/abort_request"
    assert await post(http, url, {"abort_all": True}, BOB) == (200, {"aborted": ["bob-2"]})
    events = await read_sse(bob)  # bob's call ends, aborted
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert [client_rid(a.rid) for a in backend.aborts] == ["bob-2"]
    await wait_until(lambda: "bob-2" not in keyed.state.dispatcher.inflight.calls)
    assert await post(http, url, {"abort_all": True}, ADMIN) == (200, {"aborted": ["alice-2"]})
    await backend.wait_for_abort("alice-2")
    alice.close()


async def test_a_key_over_its_inflight_budget_gets_429(
    keyed: Running, backend: FakeBackend, http
) -> None:
    alice = await hanging(http, keyed, "alice-3", ALICE)
    status = 0
    async with http.post(f"{keyed.url}/generate", json={"text": "hi"}, headers=ALICE) as r:
        status, retry = r.status, r.headers.get("Retry-After")
        error = (await r.json())["error"]
    assert (status, retry, error["type"]) == (429, "1", "rate_limit_error")
    assert "--max-inflight-per-key 1" in error["message"]
    status, answer = await post(http, f"{keyed.url}/generate", {"text": "hi"}, BOB)
    assert status == 200 and answer["text"] == "Hello world!"  # another key is not held back
    alice.close()  # the disconnect ends alice's call and frees her slot
    await wait_until(lambda: keyed.state.key_budget.inflight == {})
    status, _ = await post(http, f"{keyed.url}/generate", {"text": "hi"}, ALICE)
    assert status == 200


async def test_server_and_model_info_hide_paths_urls_and_pids_from_non_admins(
    start_gateway: Callable[..., Awaitable[Running]], redis_url: str, http
) -> None:
    keyed = await start_gateway(access=KEYS)
    info = ModelInfo(
        path="/srv/models/tiny/",
        name=MODEL,
        architecture="LlamaForCausalLM",
        context_length=64,
        vocab_size=300,
        eos_token_ids=[2],
        has_chat_template=False,
    )
    tokenizer = Service("tokenizer", "host-4242", redis_url, model=info)
    await tokenizer.beat_once()
    try:
        async with http.get(f"{keyed.url}/get_server_info", headers=ALICE) as r:
            assert r.status == 200
            public = await r.json()
        async with http.get(f"{keyed.url}/get_server_info", headers=ADMIN) as r:
            full = await r.json()
        async with http.get(f"{keyed.url}/get_model_info", headers=ALICE) as r:
            model = await r.json()
        async with http.get(f"{keyed.url}/get_model_info", headers=ADMIN) as r:
            admin_model = await r.json()
    finally:
        await tokenizer.r.aclose()
    text = json.dumps(public)
    for secret in ("redis", "127.0.0.1", "host-4242", "4242", keyed.state.settings.instance_id):
        assert secret not in text, secret
    assert public["instances"]["tokenizer"] == 1 and public["gateway"]["model_name"] == MODEL
    assert "pid" not in text and "scheduler_leader" not in public
    assert full["instances"]["tokenizer"][0]["instance"] == "host-4242"
    assert full["gateway"]["redis_url"] == redis_url
    assert model["model_path"] == model["tokenizer_path"] == "tiny"
    assert admin_model["model_path"] == "/srv/models/tiny/"
    # SGLang's keys in /get_server_info follow the same rule
    assert public["tokenizer_path"] == "tiny" and full["tokenizer_path"] == "/srv/models/tiny/"


async def test_without_keys_everything_stays_open(gw: Running, backend: FakeBackend, http) -> None:
    """No key configured: placeholder keys are ignored and everyone may do everything."""
    headers = {"Authorization": "Bearer EMPTY"}
    first = await hanging(http, gw, "open-1", {})
    assert await post(http, f"{gw.url}/abort_request", {"abort_all": True}, headers) == (
        200,
        {"aborted": ["open-1"]},
    )
    await backend.wait_for_abort("open-1")
    first.close()
    async with http.get(f"{gw.url}/get_server_info", headers=headers) as r:
        assert "redis_url" in (await r.json())["gateway"]
