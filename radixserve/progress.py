"""The model-load progress bar of `radixserve serve`, on stderr, from the executors'
LoadProgress keys. On a terminal one line is redrawn; otherwise (a log file) a line is
printed per phase and per tenth of the load, so logs stay short."""

from __future__ import annotations

import sys
from typing import TextIO

import msgspec
import redis

from shared import constants
from shared.messages.progress import LoadProgress

WIDTH = 30


def render(p: LoadProgress) -> str:
    filled = round(p.fraction * WIDTH)
    bar = "#" * filled + "-" * (WIDTH - filled)
    return f"loading model [{bar}] {p.fraction * 100:3.0f}% {p.phase} ({p.instance})"


class ProgressDisplay:
    def __init__(self, out: TextIO = sys.stderr) -> None:
        self.out = out
        self.tty = out.isatty()
        self.shown: dict[str, tuple[str, int]] = {}  # instance -> (phase, tenth) last printed
        self.drawn = False

    def show(self, items: list[LoadProgress]) -> None:
        if not items:
            self.end()  # every load finished
            return
        for p in sorted(items, key=lambda p: p.instance):
            mark = (p.phase, int(p.fraction * 10))
            if self.shown.get(p.instance) == mark and not self.tty:
                continue
            self.shown[p.instance] = mark
            if self.tty:
                self.out.write("\r" + render(p))
                self.drawn = True
            else:
                self.out.write(render(p) + "\n")
        self.out.flush()

    def end(self) -> None:
        """Leave the redrawn line before other output follows it."""
        if self.drawn:
            self.out.write("\n")
            self.out.flush()
            self.drawn = False


def read_progress(r: redis.Redis) -> list[LoadProgress]:
    decoder = msgspec.msgpack.Decoder(LoadProgress)
    keys = list(r.scan_iter(match=f"{constants.PROGRESS_PREFIX}:executor:*", count=100))
    values = r.mget(keys) if keys else []
    return [decoder.decode(v) for v in values if v is not None]
