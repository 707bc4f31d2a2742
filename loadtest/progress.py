"""A one-line progress bar on stderr (no tqdm dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`done/total [#####-----] pct  req/s  errors  elapsed`, redrawn at most 10 times a
    second so a fast run does not spend its time printing."""

    def __init__(self, total: int, enabled: bool = True, out: TextIO = sys.stderr) -> None:
        self.total, self.enabled, self.out = total, enabled, out
        self.done = self.errors = self._drawn_done = 0
        self.started = self._drawn = time.perf_counter()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        now = time.perf_counter()
        if self.enabled and (now - self._drawn >= 0.1 or self.done == self.total):
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._drawn_done = self.done
        elapsed = now - self.started
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        rate = self.done / elapsed if elapsed > 0 else 0.0
        line = (
            f"\r{self.done}/{self.total} [{bar}] {100 * frac:3.0f}% "
            f"{rate:6.2f} req/s  errors {self.errors}  {elapsed:6.1f}s"
        )
        self.out.write(line)
        self.out.flush()

    def close(self) -> None:
        if self.enabled:
            if self._drawn_done != self.done:
                self._draw(time.perf_counter())
            self.out.write("\n")
            self.out.flush()
