"""Fire-and-forget work a handler must not wait for (aborts, registry clean-up), kept so
that every task's failure is logged and the app's shutdown can let them finish."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Background:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Start `work` now; safe to call from a handler that is being cancelled."""
        task = asyncio.create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed: %r", task.get_name(), task.exception())

    async def wait(self, timeout_s: float) -> None:
        """Let the tasks already started reach Redis (at shutdown)."""
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=timeout_s)
