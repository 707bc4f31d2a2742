"""Stop strings over a stream of text deltas.

Text that could still turn into a stop string is held back until it either completes one
(generation ends there and the stop string is dropped) or can no longer match (it is released).
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string matched or None)."""
        if not self.stops:
            return text, None
        buf = self.held + text
        first: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.held = ""
            return buf[: first[0]], first[1]
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
