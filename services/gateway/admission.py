"""Admission control: whether the gateway takes one more call now, decided without awaiting.

Two caps, both answered at once with a 503 and `Retry-After` in OpenAI's error shape, so an
overloaded server refuses in a millisecond instead of queueing work that would time out:
- requests in flight through this gateway (`--max-inflight`);
- prompt tokens waiting to start in the executors (`--max-queued-tokens`), as their last
  heartbeats report them (`ExecutorLoad.waiting_tokens`), refreshed by `watch_load`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.gateway.errors import ApiError
from shared.bus import TRANSIENT
from shared.service import live_instances

log = logging.getLogger(__name__)

LOAD_REFRESH_S = 0.5


@dataclass
class Admission:
    max_inflight: int
    max_queued_tokens: int  # 0: no limit
    retry_after_s: float = 1.0
    queued_tokens: int = 0  # prompt tokens waiting in every executor, at their last heartbeat
    refused: int = 0

    def check(self, inflight: int, new: int) -> ApiError | None:
        """The error refusing `new` more requests beside `inflight` ones, or None to admit."""
        if inflight + new > self.max_inflight:
            self.refused += 1
            return ApiError(
                503,
                f"too many requests in flight (limit {self.max_inflight}); retry later",
                retry_after=self.retry_after_s,
            )
        if self.max_queued_tokens and self.queued_tokens >= self.max_queued_tokens:
            self.refused += 1
            return ApiError(
                503,
                f"{self.queued_tokens} prompt tokens are waiting to be served "
                f"(limit {self.max_queued_tokens}); retry later",
                retry_after=self.retry_after_s,
            )
        return None

    def observe(self, waiting_tokens: list[int]) -> None:
        self.queued_tokens = sum(waiting_tokens)


async def watch_load(r: aioredis.Redis, admission: Admission) -> None:
    """Keep `admission.queued_tokens` current until cancelled. While Redis is away the last
    figure stands (requests fail at publication then, with their own 503)."""
    while True:
        try:
            beats = await live_instances(r, "executor")
            admission.observe([b.executor.waiting_tokens for b in beats if b.executor])
        except TRANSIENT as e:
            log.debug("executor load unavailable: %r", e)
        await asyncio.sleep(LOAD_REFRESH_S)
