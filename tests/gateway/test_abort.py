"""POST /abort_request against the fake backend (which ends an aborted request the way the
executor does); tests/e2e/test_control_endpoints.py runs it through the real services."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from shared import constants
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import Running, read_sse, wait_until

pytestmark = pytest.mark.redis


async def abort(http: Any, gw: Running, body: Any) -> tuple[int, Any]:
    async with http.post(f"{gw.url}/abort_request", json=body) as r:
        return r.status, await r.json()


async def test_abort_ends_a_streaming_request_with_finish_reason_abort(
    gw: Running, backend: FakeBackend, aredis: aioredis.Redis, http
) -> None:
    body = {"text": "hang", "stream": True, "rid": "long-1"}
    async with http.post(f"{gw.url}/generate", json=body) as r:
        first = json.loads((await r.content.readuntil(b"\n\n")).removeprefix(b"data: "))
        assert first["meta_info"]["id"] == "long-1"
        assert await aredis.exists(constants.rid_key("long-1"))
        assert await abort(http, gw, {"rid": "long-1"}) == (200, {"aborted": ["long-1"]})
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "abort", "matched": None}
    assert (await backend.wait_for_abort("long-1")).reason == "abort_request"
    await wait_until(lambda: gw.state.router.queues == {})
    # The call is over: its registry key is gone, and a second abort finds nothing.
    for _ in range(50):
        if not await aredis.exists(constants.rid_key("long-1")):
            break
        await asyncio.sleep(0.02)
    assert not await aredis.exists(constants.rid_key("long-1"))
    status, error = await abort(http, gw, {"rid": "long-1"})
    assert status == 404 and error["error"]["param"] == "rid"
    assert "no request with rid 'long-1' is in flight" in error["error"]["message"]


async def test_abort_of_one_sample_aborts_the_whole_call(
    gw: Running, backend: FakeBackend, http
) -> None:
    body = {"prompt": "hang", "n": 2, "max_tokens": 4}
    call = asyncio.create_task(http.post(f"{gw.url}/v1/completions", json=body))
    await wait_until(lambda: len(backend.requests) == 2)
    rids = [q.trace.rid for q in backend.requests]  # in the call's order: one XADD pipeline
    assert await abort(http, gw, {"rid": rids[1]}) == (200, {"aborted": rids})
    async with await call as r:
        assert r.status == 200
        choices = (await r.json())["choices"]
    assert [c["finish_reason"] for c in choices] == ["abort", "abort"]
    assert [a.rid for a in backend.aborts] == rids


async def test_abort_all_aborts_every_call_in_flight_here(
    gw: Running, backend: FakeBackend, http
) -> None:
    calls = [
        asyncio.create_task(http.post(f"{gw.url}/generate", json={"text": "hang", "rid": rid}))
        for rid in ("a1", "a2")
    ]
    await wait_until(lambda: len(backend.requests) == 2)
    assert await abort(http, gw, {"abort_all": True}) == (200, {"aborted": ["a1", "a2"]})
    for call in calls:
        async with await call as r:
            assert (await r.json())["meta_info"]["finish_reason"]["type"] == "abort"
    assert await abort(http, gw, {"abort_all": True}) == (200, {"aborted": []})


async def test_abort_reaches_a_request_of_another_gateway(
    start_gateway: Callable[..., Awaitable[Running]], backend: FakeBackend, http
) -> None:
    owner, other = await start_gateway(), await start_gateway()
    call = asyncio.create_task(
        http.post(f"{owner.url}/generate", json={"text": "hang", "rid": "elsewhere"})
    )
    await backend.wait_for_request("hang")
    assert "elsewhere" not in other.state.dispatcher.inflight.calls
    assert await abort(http, other, {"rid": "elsewhere"}) == (200, {"aborted": ["elsewhere"]})
    async with await call as r:
        assert (await r.json())["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, "rid is required"),
        ({"rid": "x", "abort_all": True}, "not both"),
        ({"rid": "no spaces"}, "letters, digits"),
        ({"rid": 5}, "Expected `str | null`"),
        ({"rid": "x", "extra": 1}, "unknown field"),
    ],
)
async def test_bad_abort_bodies_are_400_naming_the_field(
    gw: Running, http, body: Any, words: str
) -> None:
    status, error = await abort(http, gw, body)
    assert status == 400, error
    assert words in error["error"]["message"]
    assert error["error"]["param"] == ("extra" if "extra" in body else "rid")
