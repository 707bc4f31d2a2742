"""Per-stage latency of the first token through every service: /generate reports it when
asked, and the gateway's /get_server_info keeps medians over every generation path."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from services.gateway.hop_stats import STAGES
from tests.e2e.stack import Stack
from tests.e2e.test_control_endpoints import MODEL, get, post

pytestmark = [pytest.mark.redis, pytest.mark.slow]

EVERY_STAGE = [name for name, _, _ in STAGES] + ["total"]


def check(hops: dict[str, float]) -> None:
    # every service stamped the request (one host, one clock: no stage runs backwards)
    assert list(hops) == EVERY_STAGE
    assert all(ms >= 0.0 for ms in hops.values()), hops
    parts = sum(hops[name] for name in EVERY_STAGE[:-1])
    assert abs(parts - hops["total"]) < 0.01, hops


def stream_generate(stack: Stack, body: dict[str, object]) -> list[dict[str, object]]:
    async def main() -> list[dict[str, object]]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{stack.base_url}/generate", json=body) as r,
        ):
            assert r.status == 200
            raw = (await r.read()).decode()
        return [
            json.loads(line[5:])
            for line in raw.splitlines()
            if line.startswith("data:") and line != "data: [DONE]"
        ]

    return asyncio.run(main())


def test_generate_reports_every_stage_when_asked(tiny_stack: Stack) -> None:
    _, before = get(tiny_stack, "/get_server_info")
    counted = before["gateway"]["first_token_hops"]["requests"]
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    status, plain = post(
        tiny_stack,
        "/generate",
        {"input_ids": [5, 6, 7, 8], "sampling_params": params, "return_hop_latency": True},
    )
    assert status == 200
    check(plain["meta_info"]["hop_latency_ms"])
    events = stream_generate(
        tiny_stack,
        {"text": "a b c", "sampling_params": params, "return_hop_latency": True, "stream": True},
    )
    *partial, last = events
    check(last["meta_info"]["hop_latency_ms"])  # type: ignore[index]
    assert all("hop_latency_ms" not in e["meta_info"] for e in partial)  # type: ignore[operator]
    # not asked: not reported
    status, quiet = post(tiny_stack, "/generate", {"input_ids": [5, 6], "sampling_params": params})
    assert status == 200 and "hop_latency_ms" not in quiet["meta_info"]
    # the OpenAI path is timed the same way, asked or not
    status, _ = post(
        tiny_stack, "/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2}
    )
    assert status == 200
    _, after = get(tiny_stack, "/get_server_info")
    summary = after["gateway"]["first_token_hops"]
    assert summary["requests"] == counted + 4
    assert list(summary["median_ms"]) == EVERY_STAGE
