"""`radixserve-loadtest faults`: break a running stack one way at a time under a steady load,
and count what each client request became.

    radixserve-loadtest faults --out faults.json          # the default model, on this machine
    radixserve-loadtest faults --scenarios executor,redis-restart -- --device cpu

Each scenario: requests at a steady rate until some succeed, the fault (a service SIGKILLed,
or Redis stopped and started again on the same port), then the load goes on until requests
sent after the fault succeed again. The table counts ok / retried (2xx after a 429/503 with
Retry-After) / failed-fast / hung, and the time from the fault to the first 2xx of a request
sent after it. tests/faults runs the same scenarios, shorter, and asserts on the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.burst import request_body
from loadtest.fault_load import Load, Tally, tally
from loadtest.fault_stack import RedisServer, Stack
from loadtest.hostile import HOSTILE, send_hostile

KILLABLE = ("tokenizer", "grammar", "scheduler", "detokenizer", "executor", "gateway")
SCENARIOS = (*KILLABLE, "redis-restart", "hostile")
RECOVER_S = 300.0  # how long a stack broken by the last scenario may take to serve again


@dataclass(frozen=True)
class Settings:
    interval: float = 0.25  # seconds between requests
    hang_s: float = 60.0  # no answer within this: hung
    before_ok: int = 3  # 2xx before the fault, to know the stack was serving
    after_ok: int = 3  # 2xx of requests sent after the fault: recovered
    recover_timeout: float = 90.0
    redis_down_s: float = 3.0  # how long Redis stays stopped
    max_tokens: int = 4
    extra: dict[str, Any] = field(default_factory=dict)  # more request fields

    def body(self) -> dict[str, Any]:
        return {
            **request_body("completions", "Tell me about the sea.", self.max_tokens),
            **self.extra,
        }


class NotServing(AssertionError):
    """The stack served nothing before the fault: the scenario measured nothing."""


async def under_load(stack: Stack, fault: Callable[[], object], s: Settings) -> Tally:
    """Steady requests; `fault` (run in a thread, the load going on) once some succeed; then
    until requests sent after it succeed again, or recover_timeout. Every request ends
    (answered, or hung after hang_s) before this returns."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        load = Load(session, stack.base_url + "/v1/completions", s.body(), s.interval, s.hang_s)
        load.start()
        try:
            if not await load.wait_ok(s.before_ok, 0.0, s.recover_timeout):
                outcomes = await load.stop()
                raise NotServing(f"nothing served before the fault: {tally(outcomes, None)}")
            await load.wait_busy(s.recover_timeout)
            fault_at = time.perf_counter()
            await asyncio.to_thread(fault)
            await load.wait_ok(s.after_ok, fault_at, s.recover_timeout)
        finally:
            outcomes = await load.stop()
    return tally(outcomes, fault_at)


def kill(stack: Stack, service: str) -> Callable[[], object]:
    return lambda: stack.kill(service)


def restart_redis(stack: Stack, down_s: float) -> Callable[[], object]:
    def fault() -> None:
        stack.redis.stop()
        time.sleep(down_s)  # the outage itself: its length is the scenario's parameter
        stack.redis.start()

    return fault


async def hostile_answers(stack: Stack, timeout: float) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        answers = [await send_hostile(session, stack.base_url, h, timeout) for h in HOSTILE]
    return [a.__dict__ for a in answers]


def ensure_executors(stack: Stack, n: int, executor_args: list[str], timeout: float) -> None:
    """At least n executors serving (serve starts one): their processes, and as many
    heartbeats (an executor beats once its model is loaded)."""
    from loadtest.fault_stack import wait_for

    for _ in range(n - len(stack.pids("executor"))):
        stack.add_executor(executor_args)
    wait_for(lambda: len(stack.pids("executor")) >= n, timeout, f"{n} executors")
    wait_for(lambda: stack.live_instances("executor") >= n, timeout, f"{n} executors loaded")
    stack.wait_healthy(timeout)


def run_scenario(stack: Stack, name: str, s: Settings) -> dict[str, Any]:
    started = time.monotonic()
    if name == "hostile":
        answers = asyncio.run(hostile_answers(stack, s.hang_s))
        # Answered without a 5xx: a 4xx naming the problem, or served (top_p is clamped).
        ok = sum(a["status"] is not None and a["status"] < 500 for a in answers)
        hung = sum(a["status"] is None for a in answers)
        row: dict[str, Any] = {"ok": ok, "retried": 0, "failed_fast": len(answers) - ok - hung}
        row |= {"hung": hung, "recover_s": None}
        row["answers"] = answers
    else:
        fault = (
            restart_redis(stack, s.redis_down_s) if name == "redis-restart" else kill(stack, name)
        )
        row = asyncio.run(under_load(stack, fault, s)).row()
    row["scenario"] = name
    row["seconds"] = round(time.monotonic() - started, 1)
    row["serving_after"] = stack.healthy()
    return row


def ready(stack: Stack, executor_args: list[str] | None) -> None:
    """Serving again before the next scenario: the supervisor gets time to restart what the
    last fault killed; past that, the stack is started again. With executor_args, two
    executors."""
    try:
        stack.wait_healthy(RECOVER_S)
    except (TimeoutError, RuntimeError):
        stack.stop()
        stack.start()
    if executor_args is not None:
        ensure_executors(stack, 2, executor_args, 300.0)


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'scenario':<16}{'ok':>6}{'retried':>9}{'failed-fast':>13}{'hung':>6}{'recover s':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rec = "-" if r.get("recover_s") is None else f"{r['recover_s']:.1f}"
        lines.append(
            f"{r['scenario']:<16}{r['ok']:>6}{r['retried']:>9}{r['failed_fast']:>13}"
            f"{r['hung']:>6}{rec:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="radixserve-loadtest faults", description=__doc__)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, in order")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between requests")
    p.add_argument("--hang-timeout", type=float, default=120.0)
    p.add_argument("--before-ok", type=int, default=20)
    p.add_argument("--after-ok", type=int, default=50)
    p.add_argument("--redis-down", type=float, default=5.0, help="seconds Redis stays down")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("serve_args", nargs="*", help="after --: flags for radixserve serve")
    a = p.parse_args(argv)
    names = [n for n in a.scenarios.split(",") if n]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    s = Settings(
        interval=a.interval,
        hang_s=a.hang_timeout,
        before_ok=a.before_ok,
        after_ok=a.after_ok,
        recover_timeout=max(120.0, a.hang_timeout),
        redis_down_s=a.redis_down,
        max_tokens=a.max_tokens,
    )
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="rs-faults-"))
    rows = run_all(names, s, a.serve_args, log_dir)
    print(table(rows))
    if a.out is not None:
        a.out.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)


def run_all(
    names: list[str], s: Settings, serve_args: list[str], log_dir: Path
) -> list[dict[str, Any]]:
    """Each scenario in turn on one stack (its own redis-server) of `radixserve serve
    serve_args`; a row each, printed as it ends."""
    redis = RedisServer()
    redis.start()
    stack = Stack(redis, serve_args, log_dir)
    rows: list[dict[str, Any]] = []
    try:
        print(f"serve ready in {stack.start():.1f}s (logs in {log_dir})", file=sys.stderr)
        for name in names:
            try:
                ready(stack, serve_args if name == "executor" else None)
                row = run_scenario(stack, name, s)
            except (NotServing, TimeoutError, RuntimeError) as e:
                row = {"scenario": name, "ok": 0, "retried": 0, "failed_fast": 0, "hung": 0}
                row["error"] = str(e)
            rows.append(row)
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        stack.stop()
        redis.close()
    return rows
