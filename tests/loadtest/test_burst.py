"""The burst mode against a scripted server on a real port: every request leaves at once,
and each kind of answer (or none) is counted as what it is."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from loadtest import burst
from loadtest.cli import main as cli_main
from tests.conftest import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/generate", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


def args(url: str, *extra: str) -> Any:
    import argparse

    p = argparse.ArgumentParser()
    burst.add_arguments(p)
    return p.parse_args(["--base-url", url, *extra])


def ok(body: dict[str, Any]) -> web.Response:
    return web.json_response({"choices": [{"text": "x"}], "echo": body})


async def test_every_request_is_in_flight_at_once(serve: Callable[..., Any]) -> None:
    """150 requests, more than aiohttp's default 100 connections: the server holds each answer
    until all 150 arrived, so the burst completes only if none waited for another."""
    n = 150
    arrived = asyncio.Event()
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if len(seen) == n:
            arrived.set()
        await asyncio.wait_for(arrived.wait(), 20)
        return ok(seen[-1])

    url = await serve(handler)
    summary = await burst.burst(args(url, "--n", str(n), "--max-tokens", "3", "--api-key", "k1"))
    assert summary["counts"]["2xx"] == n and summary["requests"] == n
    assert summary["latency_ms_ok"] is not None and summary["latency_ms_ok"]["p50"] > 0
    assert "api_key" not in summary["config"]  # the key is not written to the report
    assert {b["max_tokens"] for b in seen} == {3}
    assert len({b["prompt"] for b in seen}) == n  # each prompt is its own


async def test_refusals_are_counted_and_retried_after_their_hint(serve: Callable[..., Any]) -> None:
    first_seen: dict[str, float] = {}
    retried_at: dict[str, float] = {}

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        key = body["text"]
        if key not in first_seen:
            first_seen[key] = time.monotonic()
            return web.json_response(
                {"error": {"message": "busy"}}, status=429, headers={"Retry-After": "1"}
            )
        retried_at[key] = time.monotonic()
        return ok(body)

    url = await serve(handler)
    once = await burst.burst(args(url, "--n", "4", "--endpoint", "generate"))
    assert once["counts"]["429"] == 4 and once["counts"]["2xx"] == 0
    assert once["refusals_with_retry_after"] == 4 and once["retried_ok"] == 0

    first_seen.clear()
    again = await burst.burst(args(url, "--n", "4", "--endpoint", "generate", "--retry"))
    assert again["counts"]["2xx"] == 4 and again["retried_ok"] == 4
    assert again["refusals"] == 4
    # Each retry waited out the server's Retry-After of 1 s.
    assert all(retried_at[k] - first_seen[k] >= 1.0 for k in first_seen)


async def test_each_kind_of_failure_is_counted_apart(serve: Callable[..., Any]) -> None:
    statuses = iter([503, 500, 400])

    async def handler(request: web.Request) -> web.Response:
        status = next(statuses)
        return web.json_response({"error": {"message": f"scripted {status}"}}, status=status)

    url = await serve(handler)
    # --retry: a 503 without Retry-After is final, not retried.
    summary = await burst.burst(args(url, "--n", "3", "--retry"))
    assert summary["refusals"] == 1 and summary["refusals_with_retry_after"] == 0
    assert {k: v for k, v in summary["counts"].items() if v} == {"503": 1, "5xx": 1, "4xx": 1}
    assert any("scripted 500" in e for e in summary["first_errors"])


async def test_no_answer_is_hung_and_no_server_is_a_connection_error(
    serve: Callable[..., Any],
) -> None:
    never = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await never.wait()  # set when the test ends, so the server can shut down
        return ok({})

    url = await serve(handler)
    hung = await burst.burst(args(url, "--n", "3", "--hang-timeout", "0.5"))
    never.set()
    assert hung["counts"]["hung"] == 3 and hung["latency_ms_all"] is None
    closed = await burst.burst(args(f"http://127.0.0.1:{free_port()}", "--n", "2"))
    assert closed["counts"]["connection"] == 2


async def test_the_console_script_writes_its_json(
    serve: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return ok(await request.json())

    url = await serve(handler)
    out = tmp_path / "burst.json"
    argv = ["burst", "--base-url", url, "--n", "5", "--out", str(out)]
    # The CLI runs its own event loop: give it a thread so this test's loop keeps serving.
    await asyncio.to_thread(cli_main, argv)
    written = json.loads(out.read_text())
    assert written["counts"]["2xx"] == 5
    assert "5 requests" in capsys.readouterr().out


def test_the_console_script_lists_and_dispatches_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["--help"])
    assert e.value.code == 0 and "burst" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli_main(["serving", "--help"])
    assert e.value.code == 0 and "--dataset-name" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli_main(["nope"])
    assert e.value.code == 2
