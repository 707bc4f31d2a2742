"""Stop strings and stop regexes over a stream of text deltas.

Stop strings (OpenAI's `stop`): text that could still turn into a stop string is held back
until it either completes one (generation ends there and the stop string is dropped, or kept
under SGLang's no_stop_trim) or can no longer match (it is released).

Stop regexes (SGLang's `stop_regex`): searched over the text as it is released, across delta
boundaries (over the last REGEX_WINDOW characters); the first match ends the generation right
after the matched text, which stays in the output, as SGLang leaves it.
"""

from __future__ import annotations

import re

# Characters of released text a stop regex may look back over when a delta arrives.
REGEX_WINDOW = 1024


class StopStrings:
    def __init__(
        self, stops: list[str], regexes: list[str] | None = None, keep: bool = False
    ) -> None:
        self.stops = [s for s in stops if s]
        self.keep = keep  # a matched stop string stays in the output
        self.regexes = [(p, re.compile(p)) for p in regexes or []]
        self.held = ""
        self.tail = ""  # released text a regex may still match across

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string or regex matched, or None)."""
        out, matched = self._strings(text)
        if self.regexes:  # a regex match that ends before a stop string wins
            cut, pattern = self._regexes(out)
            if pattern is not None:
                return cut, pattern
        return out, matched

    def _strings(self, text: str) -> tuple[str, str | None]:
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
            end = first[0] + len(first[1]) if self.keep else first[0]
            return buf[:end], first[1]
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def _regexes(self, out: str) -> tuple[str, str | None]:
        """The regex match that ends first within `out` (the newly released text)."""
        window = self.tail + out
        start = len(self.tail)
        best: tuple[int, str] | None = None
        for pattern, rx in self.regexes:
            for m in rx.finditer(window):
                if m.end() > start:
                    if best is None or m.end() < best[0]:
                        best = (m.end(), pattern)
                    break
        if best is not None:
            self.tail = ""
            return out[: best[0] - start], best[1]
        self.tail = window[-REGEX_WINDOW:]
        return out, None

    def flush(self) -> str:
        """The held text, released without matching (the generation ended)."""
        out, self.held = self.held, ""
        return out

    def pass_through(self, text: str) -> str:
        """Release the held text and `text` without stopping (min_new_tokens not reached);
        a stop regex may still match across them later."""
        out = self.flush() + text
        if self.regexes:
            self.tail = (self.tail + out)[-REGEX_WINDOW:]
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
