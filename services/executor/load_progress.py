"""The executor's model-load progress, published for `radixserve serve`'s progress bar.

Loading happens before the service's event loop runs, so this is a plain synchronous client;
a Redis that cannot be reached only loses the progress display, never the load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import redis

from shared import constants
from shared.messages.progress import LoadProgress

log = logging.getLogger(__name__)

# Each phase's share of the whole load, in order: (phase, start, end).
PHASES = {
    "tokenizer": (0.0, 0.05),
    "weights": (0.05, 0.85),
    "kv pool": (0.85, 0.86),
    "kernel timing": (0.86, 0.9),
    "cuda graphs": (0.9, 0.97),
    "warm-up": (0.97, 1.0),
}
MIN_INTERVAL_S = 0.2  # a write per weight tensor would be hundreds per second


class ProgressReporter:
    def __init__(self, redis_url: str, instance: str) -> None:
        self.instance = instance
        self.key = constants.progress_key("executor", instance)
        self.r = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._encoder = msgspec.msgpack.Encoder()
        self._last = (0.0, "")
        self._broken = False

    def __call__(self, phase: str, done: float) -> None:
        """`done` of `phase` (0 to 1) is complete."""
        start, end = PHASES[phase]
        now = time.monotonic()
        if phase == self._last[1] and done < 1.0 and now - self._last[0] < MIN_INTERVAL_S:
            return
        self._last = (now, phase)
        fraction = start + (end - start) * min(max(done, 0.0), 1.0)
        msg = LoadProgress(instance=self.instance, phase=phase, fraction=fraction, ts=time.time())
        ttl_ms = int(constants.PROGRESS_TTL_S * 1000)
        self._write(lambda: self.r.set(self.key, self._encoder.encode(msg), px=ttl_ms))

    def finish(self) -> None:
        self._write(lambda: self.r.delete(self.key))
        self.r.close()

    def _write(self, op: Callable[[], object]) -> None:
        if self._broken:
            return
        try:
            op()
        except redis.RedisError as e:
            log.warning("cannot publish load progress: %s", e)
            self._broken = True
