"""One request as an operator's client sends it: a status, whether it was refused with a
retry hint, and whether it hung; optionally a 429/503 that carries Retry-After is sent again
after it.

Shared by the burst mode and the fault-suite driver: both count outcomes, not tokens, so the
answer is read whole (non-streaming) and only its status, headers and time are kept.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

# Final outcomes, in report order.
KINDS = ("2xx", "429", "503", "4xx", "5xx", "connection", "hung")
RETRYABLE = (429, 503)


@dataclass
class Outcome:
    """One request after every attempt; times are time.perf_counter() seconds."""

    kind: str  # one of KINDS
    status: int | None  # the last HTTP status, None when no answer came
    start: float
    end: float
    refusals: int = 0  # 429/503 answers seen over all attempts
    refusals_with_retry_after: int = 0
    error: str | None = None  # the last error's text, for the report's first errors

    @property
    def latency_s(self) -> float:
        return self.end - self.start

    @property
    def retried_ok(self) -> bool:
        return self.kind == "2xx" and self.refusals > 0


def kind_of(status: int) -> str:
    if 200 <= status < 300:
        return "2xx"
    if status in RETRYABLE:
        return str(status)
    return "4xx" if 400 <= status < 500 else "5xx"


def retry_after_s(headers: Any) -> float | None:
    """Retry-After in seconds (the delta-seconds form; the gateway sends no dates)."""
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    hang_s: float,
    retry: bool,
    headers: dict[str, str] | None = None,
) -> Outcome:
    """POST body to url until answered (retrying 429/503 when asked), within hang_s in all:
    a request with no final answer by then is "hung"."""
    start = time.perf_counter()
    deadline = start + hang_s
    out = Outcome("hung", None, start, start)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        try:
            timeout = aiohttp.ClientTimeout(total=left)
            async with session.post(url, json=body, headers=headers, timeout=timeout) as resp:
                text = await resp.text(errors="replace")
                out.status, out.kind = resp.status, kind_of(resp.status)
                wait = retry_after_s(resp.headers)
        except TimeoutError:
            out.kind, out.error = "hung", f"no answer within {hang_s:.1f}s"
            break
        except aiohttp.ClientError as e:  # refused, reset, or dropped mid-answer
            out.kind, out.error = "connection", f"{type(e).__name__}: {e}"
            break
        if out.status not in RETRYABLE:
            if out.kind != "2xx":
                out.error = f"{out.status}: {text[:300]}"
            break
        out.refusals += 1
        out.refusals_with_retry_after += wait is not None
        out.error = f"{out.status}: {text[:300]}"
        # Only a refusal that says when to come back is retried: one without Retry-After is
        # the server's final word, and counted as such.
        if not retry or wait is None or time.perf_counter() + wait >= deadline:
            break
        await asyncio.sleep(wait)
    out.end = time.perf_counter()
    return out
