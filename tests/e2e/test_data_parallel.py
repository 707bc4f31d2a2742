"""`radixserve serve --dp-size 2` on the CPU: two executors behind one scheduler. Cache-aware
routing keeps each shared prefix on one executor (the hit rate of one executor, above round
robin's), the samples of one request run where their prompt is cached, and an executor
SIGKILLed mid-generation fails none of the requests (they resume on the other)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from loadtest import serving
from loadtest.fault_stack import wait_for
from loadtest.flags import build_parser
from loadtest.metrics import Metrics
from services.scheduler import routes
from shared import constants
from shared.messages.heartbeat import ExecutorLoad
from tests.e2e.stack import Stack, sse_events, start_stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]

DB = "/5"  # the cache-aware stack's Redis database (the round-robin one runs a private Redis)
# 8 groups of 8 prompts, each a 256-token system prompt and a 32-token question, all at once.
GSP = ["--gsp-num-groups", "8", "--gsp-prompts-per-group", "8", "--gsp-system-prompt-len"]
GSP += ["256", "--gsp-question-len", "32", "--gsp-output-len", "16"]
LONG = 400  # tokens: every request is still generating when the last one streams its first


@pytest.fixture(scope="module")
def dp_stacks(
    redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Stack]]:
    """Two executors each, routed cache_aware (the default) and round_robin, started side by
    side; yielded once the scheduler of each routes to both."""
    url = redis_url.rsplit("/", 1)[0] + DB
    redis.Redis.from_url(url).flushdb()
    logs = tmp_path_factory.mktemp("dp-logs")
    args = ["--model", str(tiny_model_dir), "--max-total-tokens", "8192", "--dp-size", "2"]
    runs = {
        "cache_aware": (["--check-integrity", *args], url),
        "round_robin": ([*args, "--load-balance-method", "round_robin"], None),
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {
            name: pool.submit(start_stack, a, logs / f"{name}.log", redis_url)
            for name, (a, redis_url) in runs.items()
        }
    stacks = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        failed = [f.exception() for f in futures.values() if f.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        for s in stacks.values():
            wait_for(lambda s=s: "joined: 2 live" in log_text(s), 30, "two routed executors")
        yield stacks
    finally:
        with ThreadPoolExecutor(len(runs)) as pool:
            codes = dict(zip(stacks, pool.map(Stack.stop, stacks.values()), strict=True))
    assert codes == dict.fromkeys(runs, 0)
    for s in stacks.values():
        assert "Traceback" not in log_text(s), s.log_tail(200)


def log_text(s: Stack) -> str:
    return s.log_path.read_text(errors="replace")


def flush(s: Stack) -> None:
    async def post() -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{s.base_url}/flush_cache", json={}) as resp,
        ):
            return resp.status, await resp.text()

    status, text = asyncio.run(post())
    assert status == 200, text


def shared_prefix_run(s: Stack, model_dir: Path) -> Metrics:
    flush(s)  # every run starts from empty caches
    argv = ["--base-url", s.base_url, "--tokenizer", str(model_dir), "--disable-tqdm", *GSP]
    argv += ["--dataset-name", "generated-shared-prefix", "--warmup-requests", "0"]
    metrics = asyncio.run(serving.benchmark(build_parser().parse_args(argv)))
    assert (metrics.completed, metrics.failed) == (64, 0), metrics.errors
    return metrics


def fresh_loads(s: Stack, since: float) -> list[ExecutorLoad]:
    """Both executors' loads, once both heartbeats were sent after `since` (unix time)."""
    loads: list[ExecutorLoad] = []

    def both() -> bool:
        nonlocal loads
        loads = [b.executor for b in s.executor_loads() if b.ts > since and b.executor]
        return len(loads) == 2

    wait_for(both, 10, "fresh heartbeats of both executors")
    return loads


def test_cache_aware_keeps_each_prefix_on_one_executor(
    dp_stacks: dict[str, Stack], tiny_stack: Stack, tiny_model_dir: Path
) -> None:
    tiny_stack.wait_idle()  # the session's one-executor stack, idle to be flushed
    single = shared_prefix_run(tiny_stack, tiny_model_dir)
    cache_aware = shared_prefix_run(dp_stacks["cache_aware"], tiny_model_dir)
    round_robin = shared_prefix_run(dp_stacks["round_robin"], tiny_model_dir)
    hits = [m.cache_hit_rate for m in (single, cache_aware, round_robin)]
    assert None not in hits, hits
    one, aware, robin = (h or 0.0 for h in hits)
    assert aware >= one - 0.02, hits
    assert aware > robin, hits
    # Both executors took groups: the hit rate was not bought by using only one.
    done = time.time()
    cached = [load.cached_tokens for load in fresh_loads(dp_stacks["cache_aware"], done)]
    assert all(c >= 256 for c in cached), cached


def test_the_samples_of_one_request_run_on_one_executor(
    dp_stacks: dict[str, Stack], tiny_stack: Stack
) -> None:
    """n=4: every sample but the first takes the prompt from the cache, as with one
    executor; only one executor computed anything."""
    body = {
        "input_ids": list(range(40, 100)),
        "sampling_params": {"n": 4, "max_new_tokens": 4, "temperature": 1.0},
    }

    async def cached_per_sample(s: Stack) -> list[int]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{s.base_url}/generate", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            samples = await resp.json()
        return sorted(x["meta_info"]["cached_tokens"] for x in samples)

    stack = dp_stacks["cache_aware"]
    tiny_stack.wait_idle()
    flush(tiny_stack)
    flush(stack)
    one = asyncio.run(cached_per_sample(tiny_stack))
    two = asyncio.run(cached_per_sample(stack))
    assert one == [0, 59, 59, 59] and two == one
    cached = sorted(load.cached_tokens > 0 for load in fresh_loads(stack, time.time()))
    assert cached == [False, True]


async def stream(session: aiohttp.ClientSession, s: Stack, i: int, started: set[int]) -> int:
    """One long greedy completion; the completion tokens its usage reports."""
    body = {
        "model": "tiny-llama-11",
        "prompt": f"request {i} tells of the sea and the {i} ships",
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = -1
    async with session.post(f"{s.base_url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse_events(resp):
            started.add(i)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return int(tokens)


def held_by(s: Stack) -> dict[str, int]:
    """executor instance -> requests in flight the scheduler routed there."""
    assert s.redis_url is not None
    r = redis.Redis.from_url(s.redis_url)
    try:
        stored = [routes.decode(v) for v in r.hgetall(constants.ROUTES_KEY).values()]
    finally:
        r.close()
    out: dict[str, int] = {}
    for record in stored:
        if record is not None:
            out[record.executor] = out.get(record.executor, 0) + 1
    return out


def test_a_killed_executor_fails_none_of_the_requests(dp_stacks: dict[str, Stack]) -> None:
    """kill -9 of the executor holding the most requests, each of them mid-generation: its
    requests resume on the other from the output already streamed; every request ends with
    all its tokens, none fails, none hangs (each has a deadline here)."""
    s = dp_stacks["cache_aware"]
    n = 8
    killed: dict[str, Any] = {}
    wait_for(lambda: not held_by(s), 10, "the earlier requests' routes to be forgotten")

    async def main() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            started: set[int] = set()
            jobs = [asyncio.create_task(stream(session, s, i, started)) for i in range(n)]
            while len(started) < n and not any(j.done() for j in jobs):
                await asyncio.sleep(0.02)
            assert not any(j.done() for j in jobs), "a request ended before the fault"
            held = held_by(s)
            victim = max(held, key=lambda name: held[name])
            (beat,) = [b for b in s.executor_loads() if b.instance == victim]
            os.kill(beat.pid, signal.SIGKILL)
            killed.update(instance=victim, held=held)
            return list(await asyncio.gather(*jobs))

    tokens = asyncio.run(main())
    assert tokens == [LONG] * n
    held = killed["held"]
    assert sum(held.values()) == n and len(held) == 2, held  # both were generating
    # The scheduler saw it go (the supervisor deleted its liveness key, or its heartbeat
    # went stale) and resumed exactly the requests it held.
    victim, count = killed["instance"], held[killed["instance"]]
    word = re.compile(rf"executor {re.escape(victim)} \S.*: resuming its {count} request")
    wait_for(lambda: word.search(log_text(s)) is not None, 10, "the scheduler's word on it")
