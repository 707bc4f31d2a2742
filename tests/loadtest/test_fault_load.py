"""The fault driver against a scripted server whose behaviour the "fault" changes: each kind of
outcome lands in its own column, and recovery is timed from the fault."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from loadtest.fault_load import Load, Tally, tally


class Scripted:
    """Answers 200 until told otherwise: 'refuse' (503 + Retry-After: 1 once per request
    body), 'fail' (500), 'hang' (no answer until released)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.release = asyncio.Event()
        self.refused: set[int] = set()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.mode == "refuse" and body["n"] not in self.refused:
            self.refused.add(body["n"])
            return web.json_response({}, status=503, headers={"Retry-After": "1"})
        if self.mode == "fail":
            return web.json_response({"error": {"message": "scripted"}}, status=500)
        if self.mode == "hang":
            await self.release.wait()
        return web.json_response({"choices": []})


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    s = Scripted()
    app = web.Application()
    app.router.add_post("/v1/completions", s.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    s.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
    yield s
    s.release.set()
    await runner.cleanup()


async def drive(
    s: Scripted, mode: str, hang_s: float = 5.0, after_ok: int = 2
) -> tuple[Tally, bool]:
    counter = iter(range(10**6))

    async with aiohttp.ClientSession() as session:
        load = Load(session, s.url, lambda: {"n": next(counter)}, 0.05, hang_s)
        load.start()
        assert await load.wait_ok(3, 0.0, 10)
        fault_at = time.perf_counter()
        s.mode = mode
        await asyncio.sleep(0.5)  # the load runs on through the fault for this long
        s.mode = "ok"
        s.release.set()
        recovered = await load.wait_ok(after_ok, fault_at, 10)
        outcomes = await load.stop()
    return tally(outcomes, fault_at), recovered


async def test_refusals_with_retry_after_are_retried_not_failed(scripted: Scripted) -> None:
    t, recovered = await drive(scripted, "refuse")
    assert recovered and t.retried > 0 and (t.failed, t.hung) == (0, 0), t.row()
    assert t.recover_s is not None and t.total == t.ok + t.retried


async def test_errors_count_as_failed_fast(scripted: Scripted) -> None:
    t, _ = await drive(scripted, "fail")
    assert t.failed > 0 and t.hung == 0, t.row()
    assert any("500" in e for e in t.errors)


async def test_no_answer_within_the_bound_is_hung(scripted: Scripted) -> None:
    t, _ = await drive(scripted, "hang", hang_s=0.3)
    assert t.hung > 0 and t.failed == 0, t.row()


def test_the_faults_command_refuses_unknown_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest.cli import main

    with pytest.raises(SystemExit) as e:
        main(["faults", "--scenarios", "tokenizer,typo"])
    assert "typo" in str(e.value) and "redis-restart" in str(e.value)
