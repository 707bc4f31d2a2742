"""`radixserve serve` as a supervisor: a child killed is started again, /health says so while
it is gone, serve itself stays up, and so does its private redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from loadtest.attempt import send
from loadtest.fault_stack import Stack, children, cmdline, wait_for
from loadtest.faults import Settings
from tests.e2e.stack import start_stack

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.faults]


def health_status(base_url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


async def ordinary_request(base_url: str) -> int | None:
    async with aiohttp.ClientSession() as session:
        out = await send(session, base_url + "/v1/completions", Settings().body(), 60, True)
    return out.status


def test_a_killed_child_is_restarted_and_health_reports_the_gap(fault_stack: Stack) -> None:
    old = fault_stack.kill("scheduler")
    # /health turns 503 while a stage is gone (the issue: within about 2 s).
    deadline = time.monotonic() + 5.0
    seen = []
    while time.monotonic() < deadline:
        seen.append(health_status(fault_stack.base_url))
        if seen[-1] == 503:
            break
        time.sleep(0.1)
    assert seen[-1] == 503, f"/health answered {seen} with the scheduler dead"
    fault_stack.wait_replaced("scheduler", old, 60)
    fault_stack.wait_healthy(60)
    assert fault_stack.serve_alive(), fault_stack.log_tail()
    assert asyncio.run(ordinary_request(fault_stack.base_url)) == 200


def test_serve_restarts_its_own_redis_server(
    fault_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Without REDIS_URL serve runs a private redis-server: killed, it is started again and
    the stack serves again (its services ride out the restart as any Redis restart)."""
    args = ["--model", str(fault_model_dir), "--device", "cpu", "--max-total-tokens", "2048"]
    stack = start_stack(args, tmp_path_factory.mktemp("private") / "serve.log", redis_url=None)
    try:

        def redis_pids() -> list[int]:
            return [p for p in children(stack.proc.pid) if "redis-server" in " ".join(cmdline(p))]

        (old,) = redis_pids()
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: any(p != old for p in redis_pids()), 30, "a new redis-server")
        wait_for(lambda: health_status(stack.base_url) == 200, 60, "/health 200")
        assert asyncio.run(ordinary_request(stack.base_url)) == 200, stack.log_tail()
    finally:
        code = stack.stop()
    assert code == 0, stack.log_tail()
