"""Host time per engine phase: where a step's CPU time goes while the device runs.

Wraps the engine's phases on the instances (the classes are untouched) and sums wall time per
phase; `per_step()` divides by the steps launched since `start()`. Waiting for the device
is `wait`, a part of `finish` (landing the previous step's tokens); `collect` builds the
step's outputs.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from services.executor.engine.loop import Engine


class HostTimes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps0 = engine.step_no
        self._wrap(engine.policy, "plan", "plan")
        self._wrap(engine.runner, "forward", "launch")
        self._wrap(engine.sampler, "sample", "sample")
        self._wrap(engine, "_tokens_on_host", "wait")  # inside finish: blocked on the device
        self._wrap(engine, "_land", "finish")
        self._wrap(engine, "_result", "collect")
        self._wrap(engine, "step", "step")

    def _wrap(self, obj: Any, attr: str, name: str) -> None:
        inner: Callable[..., Any] = getattr(obj, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def start(self) -> None:
        self.seconds.clear()
        self.steps0 = self.engine.step_no

    def per_step(self) -> dict[str, float]:
        """Milliseconds per launched step in each phase ("step" is the whole call)."""
        steps = max(1, self.engine.step_no - self.steps0)
        return {k: round(1000 * v / steps, 3) for k, v in sorted(self.seconds.items())}
