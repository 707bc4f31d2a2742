"""A whole stack across a Redis restart: Redis is killed under load and started again, empty,
on the same port. In-flight requests end (a retryable 503 with Retry-After, or done), none
hangs, /health says 503 while Redis is away, and new requests are served afterwards."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.stack import Stack, start_stack
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.slow]

LONG: dict[str, object] = {
    "input_ids": [5, 6, 7, 8],
    "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
}
SHORT: dict[str, object] = {
    "input_ids": [9, 10, 11],
    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
}


@pytest.fixture
def restart_stack(
    restartable_redis: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[Stack]:
    stack = start_stack(
        ["--model", str(tiny_model_dir), "--max-total-tokens", "16384"],
        tmp_path / "serve.log",
        restartable_redis.url,
    )
    yield stack
    code = stack.stop()
    assert code == 0, f"serve exited with {code}\n{stack.log_tail()}"


def health(stack: Stack) -> int:
    try:
        with urllib.request.urlopen(f"{stack.base_url}/health", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def wait_for(check: Callable[[], bool], what: str, stack: Stack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout}s\n{stack.log_tail()}")
        time.sleep(0.1)


def running(stack: Stack) -> int:
    return sum(b.executor.running for b in stack.executor_loads() if b.executor is not None)


def test_a_redis_restart_fails_in_flight_requests_clearly_and_serving_resumes(
    restart_stack: Stack, restartable_redis: RedisServer
) -> None:
    stack = restart_stack
    url = f"{stack.base_url}/generate"

    async def call(s: aiohttp.ClientSession, body: Mapping[str, object]) -> tuple[int, str | None]:
        async with s.post(url, json=body) as resp:
            await resp.read()
            return resp.status, resp.headers.get("Retry-After")

    async def main() -> None:
        timeout = aiohttp.ClientTimeout(total=60)  # a hang shows as a client timeout
        async with aiohttp.ClientSession(timeout=timeout) as s:
            assert (await call(s, SHORT))[0] == 200
            in_flight = [asyncio.create_task(call(s, LONG)) for _ in range(3)]
            await asyncio.to_thread(wait_for, lambda: running(stack) == 3, "3 running", stack)

            restartable_redis.stop()
            await asyncio.to_thread(wait_for, lambda: health(stack) == 503, "/health 503", stack)
            restartable_redis.start()

            ended = await asyncio.wait_for(asyncio.gather(*in_flight), 40)
            # Their state went with the old server: each fails, retryable, and says when.
            assert ended == [(503, "1")] * 3, ended

            await asyncio.to_thread(wait_for, lambda: health(stack) == 200, "/health 200", stack)
            again = await asyncio.gather(*(call(s, SHORT) for _ in range(4)))
            assert [status for status, _ in again] == [200] * 4

    asyncio.run(main())
    # The executor ended the requests from before the restart: no KV slot is left held.
    stack.wait_idle(timeout=20.0)
