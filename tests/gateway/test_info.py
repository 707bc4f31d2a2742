"""GET /get_model_info and /get_server_info from heartbeats, and /health_generate's probe
against the fake backend."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

import radixserve
from services.gateway import health_api
from services.gateway.info_api import redact
from shared import constants
from shared.messages.heartbeat import ExecutorLoad, ModelInfo
from shared.service import Service
from tests.gateway.fake_backend import FakeBackend, client_rid
from tests.gateway.helpers import MODEL, Running

pytestmark = pytest.mark.redis

INFO = ModelInfo(
    path="/models/tiny",
    name=MODEL,
    architecture="LlamaForCausalLM",
    context_length=4096,
    vocab_size=320,
    eos_token_ids=[2],
    has_chat_template=True,
)
LOAD = ExecutorLoad(
    stream="rs:exec:e1",
    model=MODEL,
    context_length=2048,
    waiting=1,
    running=2,
    free_kv_tokens=900,
    total_kv_tokens=1000,
    cached_tokens=60,
    gen_throughput=123.5,
)


@pytest.fixture
async def services(redis_url: str) -> AsyncIterator[list[Service]]:
    """A live tokenizer (with the model's description) and executor (with its load)."""
    live = [
        Service("tokenizer", "t1", redis_url, model=INFO),
        Service("executor", "e1", redis_url, load=lambda: LOAD),
    ]
    for s in live:
        await s.beat_once()
    yield live
    for s in live:
        await s.r.aclose()


async def test_model_info_with_nothing_live_says_what_it_cannot_tell(gw: Running, http) -> None:
    async with http.get(f"{gw.url}/get_model_info") as r:
        assert r.status == 200
        body = await r.json()
    assert body["served_model_name"] == MODEL and body["is_generation"] is True
    assert body["context_length"] is None and body["architecture"] is None


async def test_model_info_from_heartbeats(gw: Running, services: list[Service], http) -> None:
    async with http.get(f"{gw.url}/get_model_info") as r:
        body = await r.json()
    assert body == {
        "model_path": "/models/tiny",
        "tokenizer_path": "/models/tiny",
        "served_model_name": MODEL,
        "is_generation": True,
        "context_length": 2048,  # the executor's, which may be shorter than the checkpoint's
        "architecture": "LlamaForCausalLM",
        "vocab_size": 320,
        "eos_token_ids": [2],
        "has_chat_template": True,
    }


async def test_server_info(
    gw: Running, services: list[Service], aredis: aioredis.Redis, http
) -> None:
    await aredis.set(constants.SCHEDULER_LEADER_KEY, "s1")
    async with http.get(f"{gw.url}/get_server_info") as r:
        assert r.status == 200
        body = await r.json()
    settings = gw.state.settings
    assert body["gateway"]["instance_id"] == settings.instance_id
    assert body["gateway"]["request_timeout_s"] == settings.request_timeout_s
    assert body["gateway"]["inflight"] == 0 and body["gateway"]["draining"] is False
    assert body["scheduler_leader"] == "s1"
    assert [i["instance"] for i in body["instances"]["tokenizer"]] == ["t1"]
    assert body["instances"]["grammar"] == [] and body["instances"]["gateway"] == []
    assert 0 <= body["instances"]["executor"][0]["heartbeat_age_s"] < 10
    (executor,) = body["executors"]
    assert executor["instance"] == "e1"
    assert executor["free_kv_tokens"] == 900 and executor["total_kv_tokens"] == 1000
    assert executor["waiting"] == 1 and executor["running"] == 2
    # SGLang's keys, which its tools read (bench_one_batch_server, its router)
    assert body["tokenizer_path"] == body["model_path"] == "/models/tiny"
    assert (body["dp_size"], body["tp_size"], body["max_total_num_tokens"]) == (1, 1, 1000)
    (internal,) = body["internal_states"]
    assert internal["last_gen_throughput"] == LOAD.gen_throughput
    assert (internal["num_running_reqs"], internal["num_waiting_reqs"]) == (2, 1)
    assert body["version"] == radixserve.__version__


async def ok_json(http: Any, url: str) -> Any:
    async with http.get(url) as r:
        assert r.status == 200
        return await r.json()


async def test_load_per_executor_as_sglang_reports_it(
    gw: Running, services: list[Service], http
) -> None:
    body = await ok_json(http, f"{gw.url}/get_load")
    # 100 of 1,000 slots used (none evictable), no prompt waiting to start
    assert body == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 100}]


async def test_load_with_no_executor_is_empty(gw: Running, http) -> None:
    async with http.get(f"{gw.url}/get_load") as r:
        assert r.status == 200 and await r.json() == []


async def test_v1_loads_is_the_grpc_answer_as_json(
    gw: Running, services: list[Service], http
) -> None:
    body = await ok_json(http, f"{gw.url}/v1/loads")
    assert body["dp_rank_count"] == 1 and body["version"].startswith("radixserve-")
    (load,) = body["loads"]
    assert load["dp_rank"] == 0 and load["num_total_reqs"] == 3
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (2, 1)
    assert load["num_used_tokens"] == 100 and load["max_total_num_tokens"] == 1000
    assert load["token_usage"] == pytest.approx(0.1)
    assert load["memory"]["token_capacity"] == 1000  # every section unless include says
    assert body["aggregate"]["total_reqs"] == 3
    async with http.get(f"{gw.url}/v1/loads?include=core&dp_rank=0") as r:
        assert r.status == 200 and "memory" not in (await r.json())["loads"][0]
    for query, param in (
        ("dp_rank=1", "dp_rank"),
        ("dp_rank=x", "dp_rank"),
        ("include=gpu", "include"),
        ("format=prometheus", "format"),
    ):
        async with http.get(f"{gw.url}/v1/loads?{query}") as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == param


async def test_sglangs_newer_names_answer_the_same(
    gw: Running, services: list[Service], http
) -> None:
    for old, new in (("/get_model_info", "/model_info"), ("/get_server_info", "/server_info")):
        async with http.get(f"{gw.url}{old}") as a, http.get(f"{gw.url}{new}") as b:
            first, second = await a.json(), await b.json()
        if "gateway" in first:  # its in-flight count and hop medians move between calls
            first["gateway"].pop("first_token_hops"), second["gateway"].pop("first_token_hops")
            for found in (first, second):
                for beats in found["instances"].values():
                    for beat in beats:
                        beat.pop("heartbeat_age_s")
        assert first == second
    async with http.get(f"{gw.url}/version") as r:
        assert (await r.json())["version"] == radixserve.__version__


def test_redis_passwords_are_redacted() -> None:
    assert redact("redis://:s3cret@db:6380/1") == "redis://:***@db:6380/1"
    assert redact("redis://me:s3cret@db/0") == "redis://me:***@db/0"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_health_generate_sends_a_one_token_greedy_probe(
    gw: Running, backend: FakeBackend, http, method: str
) -> None:
    async with http.request(method, f"{gw.url}/health_generate") as r:
        assert r.status == 200
        body = await r.json()
    assert body["status"] == "ok" and body["token_ids"] == [101, 102, 103]
    assert 0 < body["latency_s"] < 5
    (probe,) = backend.requests
    assert client_rid(probe.trace.rid) == body["rid"]
    assert time.time() < probe.trace.deadline <= time.time() + health_api.PROBE_TIMEOUT_S
    assert probe.sampling.max_new_tokens == 1 and probe.sampling.temperature == 0


async def test_health_generate_failure_is_a_503_with_the_reason(
    gw: Running, monkeypatch: pytest.MonkeyPatch, http
) -> None:
    monkeypatch.setattr(health_api, "PROBE_PROMPT", "busy")  # the backend answers 503
    async with http.get(f"{gw.url}/health_generate") as r:
        assert r.status == 503
        body = await r.json()
    assert body["status"] == "unavailable"
    assert body["error"]["message"] == "the probe failed: queue is full"


async def test_health_generate_timeout_is_a_503_and_aborts_the_probe(
    gw: Running, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch, http
) -> None:
    monkeypatch.setattr(health_api, "PROBE_PROMPT", "silent")
    monkeypatch.setattr(health_api, "PROBE_TIMEOUT_S", 0.3)
    async with http.get(f"{gw.url}/health_generate") as r:
        assert r.status == 503
        body = await r.json()
    assert body["status"] == "timeout" and "within 0.3s" in body["error"]["message"]
    (probe,) = backend.requests
    assert (await backend.wait_for_abort(probe.trace.rid)).reason == "deadline"
