"""An executor SIGKILLed mid-generation with another one running: its requests resume on the
other (prompt plus the output already streamed, prefilled there), and each ends with exactly
the text of an uninterrupted run. Both ways an executor's death is noticed are exercised: a
process the supervisor watches (its liveness key is deleted at once) and one it does not (its
heartbeat goes stale within 2 s), and an executor lost while the scheduler itself is being
restarted."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import redis

from loadtest.fault_stack import RedisServer, Stack, wait_for
from services.scheduler import routes
from shared import constants
from shared.messages.heartbeat import Heartbeat
from tests.e2e.test_detokenizer_takeover import run_all
from tests.executor.helpers import write_tiny_model

pytestmark = [pytest.mark.redis, pytest.mark.slow]

# Long answers: every request is still generating when the last one streams its first chunk
# (the fault comes then), on whichever executor it runs.
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("failover-model"), "llama", 11)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server = RedisServer()
    server.start()
    # Least-loaded routing: the rounds send the same prompts again and need them on both
    # executors, where cache-aware routing would keep them on the one that cached them.
    args = [*executor_args(model_dir), "--load-balance-method", "least_load"]
    s = Stack(server, args, tmp_path_factory.mktemp("failover-logs"))
    try:
        s.start(timeout=300)
        yield s
    finally:
        s.stop()
        server.close()


def executor_args(model: Path) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--max-total-tokens", "8192"]


def executor_beats(s: Stack) -> dict[int, Heartbeat]:
    """pid -> heartbeat of the executors with a liveness key."""
    r = redis.Redis.from_url(s.redis.url)
    decode = msgspec.msgpack.Decoder(Heartbeat).decode
    try:
        keys = r.keys(constants.live_key("executor", "*"))
        beats = [decode(v) for v in r.mget(keys) if v] if keys else []
        return {hb.pid: hb for hb in beats}
    finally:
        r.close()


def executor_pids(s: Stack) -> list[int]:
    return sorted(executor_beats(s))


def has_served(s: Stack, pid: int) -> bool:
    """Whether the executor has computed a prompt (its cache holds one)."""
    hb = executor_beats(s).get(pid)
    return hb is not None and hb.executor is not None and hb.executor.cached_tokens > 0


def all_idle(s: Stack) -> bool:
    live = set(s.pids("executor"))
    beats = [hb for pid, hb in executor_beats(s).items() if pid in live]
    return len(beats) == len(live) and all(
        hb.executor is not None and hb.executor.running + hb.executor.waiting == 0 for hb in beats
    )


def resumed(s: Stack) -> list[int]:
    """The output tokens each request resumed on another executor had (detokenizer's log)."""
    text = s.log_path.read_text(errors="replace")
    return [int(n) for n in re.findall(r"lost executor \S+ after (\d+) token", text)]


def routes_on(s: Stack, instance: str) -> int:
    """Requests in flight routed to the executor `instance` (the scheduler's table)."""
    r = redis.Redis.from_url(s.redis.url)
    try:
        stored = [routes.decode(v) for v in r.hgetall(constants.ROUTES_KEY).values()]
    finally:
        r.close()
    return sum(rec is not None and rec.executor == instance for rec in stored)


def serve_executors(stack: Stack) -> list[int]:
    """The executors serve runs (not the ones the test added)."""
    extras = {p.pid for p in stack.extra}
    return [p for p in stack.pids("executor") if p not in extras]


def test_a_killed_executors_requests_resume_elsewhere_with_the_same_text(
    stack: Stack, model_dir: Path
) -> None:
    with urllib.request.urlopen(f"{stack.base_url}/v1/models") as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    reference = asyncio.run(run_all(stack, model, max_tokens=MAX_TOKENS))
    assert all(text for text, _ in reference)

    def two_executors() -> None:
        """Two live executors that both serve (one added when fewer run), idle."""
        # serve's own executor first: killed in the round before, it may still be in its
        # restart backoff, and an extra added then would make three
        wait_for(lambda: serve_executors(stack), 120, "serve's executor")
        if len(stack.pids("executor")) < 2:
            extra = stack.add_executor(executor_args(model_dir))
            wait_for(lambda: extra.pid in executor_pids(stack), 120, "the second executor")
        pids = stack.pids("executor")
        assert len(pids) == 2
        wait_for(lambda: set(pids) <= set(executor_pids(stack)), 120, "both heartbeats")

        # Until the scheduler routes to both (it learns of executors every 0.2 s; a restarted
        # one joins once it has loaded): a request of two tokens puts its prompt in the cache
        # that has_served reads.
        def both_served() -> bool:
            asyncio.run(run_all(stack, model, max_tokens=2))
            return all(has_served(stack, p) for p in pids)

        wait_for(both_served, 120, "requests served by both executors")
        # Both idle in their heartbeats, so the scheduler spreads the next requests evenly.
        wait_for(lambda: all_idle(stack), 30, "idle executors")

    def fault_round(target: int, before: Callable[[], object] = lambda: None) -> None:
        """Requests as in the reference; once each has streamed, `before()` and SIGKILL of
        executor `target`, if it holds some of them then (else, or when a request ended
        before every one had streamed, the round is run again)."""
        instance = executor_beats(stack)[target].instance
        killed: list[int] = []

        def fault() -> None:
            if routes_on(stack, instance):
                before()
                os.kill(target, signal.SIGKILL)
                killed.append(target)

        for _ in range(5):
            seen = len(resumed(stack))
            faulted = asyncio.run(run_all(stack, model, fault, MAX_TOKENS, early_ok=True))
            assert faulted == reference  # same text, same token counts; none failed or hung
            if killed:
                # It held requests mid-generation: they went on elsewhere from their output.
                assert any(n > 0 for n in resumed(stack)[seen:]), resumed(stack)[seen:]
                return
        raise AssertionError(f"executor {instance} never held a request when the fault came")

    # 1. The executor the supervisor does not watch: noticed by its stale heartbeat.
    two_executors()
    fault_round(stack.extra[-1].pid)

    # 2. The supervisor's own executor: its exit deletes the liveness key at once.
    two_executors()
    fault_round(next(p for p in stack.pids("executor") if p != stack.extra[-1].pid))

    # 3. The scheduler first, then an executor, while no scheduler runs: the restarted
    # scheduler rebuilds its routing table from Redis and resumes the executor's requests.
    two_executors()
    scheduler = stack.pids("scheduler")[0]
    fault_round(stack.extra[-1].pid, before=lambda: os.kill(scheduler, signal.SIGKILL))
    assert re.search(r"restored \d+ route", stack.log_path.read_text(errors="replace"))
    assert "Traceback" not in stack.log_path.read_text(errors="replace")
