"""Host time per engine phase: where a step's CPU time goes while the device runs.

Wraps the engine's phases on the instances (the classes are untouched) and sums wall time per
phase; `per_step()` divides by the steps launched since `start()`. Waiting for the device
is `wait`, a part of `finish` (landing the previous step's tokens); `collect` builds the
step's outputs. `medians()` gives each phase's median over the steps (a CPU run's figures
are noisy: another process's time lands in a few steps, not in the median).
"""

from __future__ import annotations

import functools
import statistics
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
        self._step: dict[str, float] = defaultdict(float)  # the step being timed
        self.history: list[dict[str, float]] = []  # each step's seconds per phase
        self.decode: list[bool] = []  # whether each of those steps launched a DECODE
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
            result = None
            try:
                result = inner(*args, **kwargs)
                return result
            finally:
                spent = time.perf_counter() - t0
                self.seconds[name] += spent
                self._step[name] += spent
                if name == "step":  # the outermost call: this step is done
                    self.history.append(dict(self._step))
                    self.decode.append(bool(getattr(result, "is_decode", False)))
                    self._step.clear()

        setattr(obj, attr, timed)

    def start(self) -> None:
        self.seconds.clear()
        self.history.clear()
        self.decode.clear()
        self.steps0 = self.engine.step_no

    def per_step(self) -> dict[str, float]:
        """Milliseconds per launched step in each phase ("step" is the whole call)."""
        steps = max(1, self.engine.step_no - self.steps0)
        return {k: round(1000 * v / steps, 3) for k, v in sorted(self.seconds.items())}

    def medians(self, decode_only: bool = True) -> dict[str, float]:
        """Each phase's median milliseconds over the steps timed since `start()` that launched
        a DECODE (all of them with decode_only=False); a phase a step did not enter counts 0
        there. Issue 26's figure is per decode step: the mean of `per_step()` also spreads the
        prefill's eager extend steps over the run."""
        steps = [h for h, d in zip(self.history, self.decode, strict=True) if d or not decode_only]
        if not steps:
            return {}
        names = sorted({k for h in steps for k in h})
        return {k: round(1000 * statistics.median(h.get(k, 0.0) for h in steps), 3) for k in names}
