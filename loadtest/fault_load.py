"""A steady stream of requests while something breaks, and what became of each.

Every request is sent with loadtest.attempt.send: a 429/503 that carries Retry-After is sent
again after it (within the hang bound), so the tally says what a well-behaved client sees:

  ok          answered 2xx at the first attempt
  retried     answered 2xx after one or more 429/503 with Retry-After
  failed      a final error answer, or a connection error: fast, the client knows
  hung        no answer within the hang bound: the failure the issue forbids
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.attempt import Outcome, send

FIRST_ERRORS = 5


@dataclass
class Tally:
    ok: int = 0
    retried: int = 0
    failed: int = 0
    hung: int = 0
    recover_s: float | None = None  # the fault until the first 2xx of a request sent after it
    in_flight_at_fault: int = 0  # requests sent before the fault and answered after it
    errors: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.ok + self.retried + self.failed + self.hung

    def row(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "retried": self.retried,
            "failed_fast": self.failed,
            "hung": self.hung,
            "recover_s": None if self.recover_s is None else round(self.recover_s, 2),
            "in_flight_at_fault": self.in_flight_at_fault,
            "first_errors": self.errors[:FIRST_ERRORS],
        }


def tally(outcomes: list[Outcome], fault_at: float | None) -> Tally:
    t = Tally()
    for o in outcomes:
        if o.kind == "2xx":
            if o.refusals:
                t.retried += 1
            else:
                t.ok += 1
        elif o.kind == "hung":
            t.hung += 1
        else:
            t.failed += 1
        if o.kind != "2xx" and o.error and len(t.errors) < FIRST_ERRORS:
            t.errors.append(f"{o.kind}: {o.error}")
    if fault_at is not None:
        after = [o.end for o in outcomes if o.kind == "2xx" and o.start >= fault_at]
        t.recover_s = min(after) - fault_at if after else None
        t.in_flight_at_fault = sum(o.start < fault_at < o.end for o in outcomes)
    return t


class Load:
    """Sends one request every `interval` seconds until stopped; each runs to its end."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any] | Callable[[], dict[str, Any]],  # the same body, or a new each time
        interval: float,
        hang_s: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.session, self.url, self.body, self.headers = session, url, body, headers
        self.interval, self.hang_s = interval, hang_s
        self.outcomes: list[Outcome] = []
        self._requests: set[asyncio.Task[None]] = set()
        self._pacer: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.in_flight = 0  # requests sent (their start time taken) and not yet answered

    def start(self) -> None:
        self._pacer = asyncio.create_task(self._pace())

    async def _pace(self) -> None:
        next_at = time.perf_counter()
        while True:
            task = asyncio.create_task(self._one())
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
            next_at += self.interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    async def _one(self) -> None:
        body = self.body() if callable(self.body) else self.body
        self.in_flight += 1  # send() takes its start time before its first await
        try:
            out = await send(self.session, self.url, body, self.hang_s, True, self.headers)
        finally:
            self.in_flight -= 1
        self.outcomes.append(out)
        self._changed.set()

    def ok_since(self, t: float) -> int:
        return sum(o.kind == "2xx" and o.start >= t for o in self.outcomes)

    async def wait_ok(self, n: int, since: float, timeout: float) -> bool:
        """Until n requests sent at or after `since` (perf_counter) answered 2xx."""
        deadline = time.perf_counter() + timeout
        while self.ok_since(since) < n:
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return False
        return True

    async def wait_busy(self, timeout: float) -> bool:
        """Until a request is in flight, so that a fault meets work mid-way."""
        deadline = time.perf_counter() + timeout
        while not self.in_flight:
            if time.perf_counter() >= deadline:
                return False
            await asyncio.sleep(0.005)  # polled: the pacer starts requests on its own clock
        return True

    async def stop(self) -> list[Outcome]:
        """No new requests; wait for those in flight (each ends within the hang bound)."""
        if self._pacer is not None:
            self._pacer.cancel()
            await asyncio.gather(self._pacer, return_exceptions=True)
        await asyncio.gather(*list(self._requests), return_exceptions=True)
        return self.outcomes
