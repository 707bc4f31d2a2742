"""The executor's publisher: each step's outputs go out in step order, through Redis outages.

A batch that fails with a transient error is retried (with backoff) before any later batch is
tried, so a client never sees token N+1 before token N and no step's tokens are dropped while
Redis is away. Any other error propagates: the executor stops loudly and is restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from shared.bus import TRANSIENT, Backoff

log = logging.getLogger(__name__)

Outputs = list[tuple[str, Any]]


async def send_in_order(
    outbox: asyncio.Queue[Outputs], publish: Callable[[Outputs], Awaitable[None]]
) -> None:
    """Publish every batch put into `outbox`, one at a time, until cancelled."""
    backoff = Backoff(base=0.05, cap=1.0)
    while True:
        outputs = await outbox.get()
        try:
            while True:
                try:
                    await publish(outputs)
                    break
                except TRANSIENT as e:
                    if backoff.attempt == 0:  # once per outage, not once per attempt
                        log.warning("publishing outputs failed (%r); retrying in order", e)
                    await backoff.wait()
            if backoff.attempt:
                log.info("publishing again after %d failed attempt(s)", backoff.attempt)
                backoff.reset()
        finally:
            outbox.task_done()
