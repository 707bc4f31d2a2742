"""Readiness: the pure computation, and the gateway refusing requests until the stack is
first ready."""

from __future__ import annotations

import uuid

import aiohttp
import pytest
import redis.asyncio as aioredis

from services.gateway.app import bound_port, build_app, start_site
from services.gateway.readiness import PIPELINE, assess
from services.gateway.state import STATE, GatewaySettings
from shared import constants
from shared.messages.heartbeat import ExecutorLoad, Heartbeat
from shared.service import Service
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import MODEL, wait_until

NOW = 1000.0
LOAD = ExecutorLoad(
    stream="s", model="m", context_length=8, waiting=0, running=0, free_kv_tokens=1,
    total_kv_tokens=1,
)  # fmt: skip


def beat(service: str, instance: str = "a", age: float = 0.1) -> Heartbeat:
    return Heartbeat(
        service=service,
        instance=instance,
        pid=1,
        started=0.0,
        ts=NOW - age,
        executor=LOAD if service == "executor" else None,
    )


def test_every_stage_fresh_and_a_leading_scheduler_is_ready() -> None:
    r = assess([beat(s) for s in PIPELINE], "a", NOW)
    assert r.ready and r.missing == [] and r.instances == dict.fromkeys(PIPELINE, 1)


def test_nothing_live_names_every_stage() -> None:
    r = assess([], None, NOW)
    assert not r.ready and r.missing == list(PIPELINE)
    assert r.reasons["executor"] == "no live instance"


def test_a_stale_heartbeat_counts_as_gone() -> None:
    beats = [beat(s) for s in PIPELINE if s != "detokenizer"] + [beat("detokenizer", age=2.5)]
    r = assess(beats, "a", NOW)
    assert r.missing == ["detokenizer"] and "no heartbeat within 2s" in r.message()
    # A second, fresh instance of the stage is enough.
    assert assess([*beats, beat("detokenizer", "b")], "a", NOW).ready


def test_the_scheduler_must_be_the_live_leader() -> None:
    beats = [beat(s) for s in PIPELINE]
    assert assess(beats, None, NOW).missing == ["scheduler"]
    r = assess(beats, "dead-one", NOW)
    assert r.missing == ["scheduler"] and "dead-one" in r.reasons["scheduler"]


def test_gateways_and_other_services_do_not_count() -> None:
    beats = [beat(s) for s in PIPELINE if s != "tokenizer"] + [beat("gateway")]
    assert assess(beats, "a", NOW).missing == ["tokenizer"]


@pytest.mark.redis
async def test_requests_get_503_with_retry_after_until_the_stack_is_ready(
    redis_url: str, aredis: aioredis.Redis, backend: FakeBackend
) -> None:
    settings = GatewaySettings(
        redis_url=redis_url,
        instance_id=f"gw-{uuid.uuid4().hex[:8]}",
        model_name=MODEL,
        request_timeout_s=5.0,
        wait_until_ready=True,
    )
    app = await build_app(settings)
    runner = await start_site(app, "127.0.0.1", 0, shutdown_timeout=2.0)
    url = f"http://127.0.0.1:{bound_port(runner)}"
    services = [Service(s, "i1", redis_url) for s in PIPELINE]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "2"
                error = (await r.json())["error"]
            assert error["type"] == "service_unavailable" and "starting" in error["message"]
            for s in services:
                await s.beat_once()
            await aredis.set(constants.SCHEDULER_LEADER_KEY, "i1", px=10_000)
            await wait_until(app[STATE].ready.is_set, timeout=5.0)
            async with http.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["text"]
            # Only the first readiness gates: a stage gone later does not refuse requests.
            await aredis.delete(constants.live_key("tokenizer", "i1"))
            async with http.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
    finally:
        await runner.cleanup()
        for s in services:
            await s.r.aclose()


def test_every_detokenizer_partition_needs_a_live_owner() -> None:
    beats = [beat(s) for s in PIPELINE] + [beat("detokenizer", "b"), beat("detokenizer", "c", 5)]
    assert assess(beats, "a", NOW, detok_owners=["a", "b"]).ready
    # Partition 1's owner died (stale heartbeat) and partition 2 has none: a live standby
    # ("b" owns another) does not make them servable until it takes them over.
    r = assess(beats, "a", NOW, detok_owners=["b", "c", None])
    assert r.missing == ["detokenizer"]
    assert r.reasons["detokenizer"] == "no live owner of partition(s) 1, 2"
