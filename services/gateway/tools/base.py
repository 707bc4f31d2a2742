"""The streaming skeleton every format shares: content flows out until a call's start
marker; a suffix that may be the start of a marker is held back (so a marker split across
deltas never leaks into the content); a call's text is held until its end marker (or the
end of the output, for formats without one) and then parsed. A call that does not parse is
content after all."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ParseStep:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ParseStep) -> ParseStep:
        self.content += other.content
        self.calls += other.calls
        return self


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def arguments_json(value: Any) -> str | None:
    """A call's arguments as JSON text of an object (a string holding one is accepted)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class ToolCallParser:
    start = ""  # the marker that opens a call
    end = ""  # the marker that closes it ("": the call runs to the end of the output)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools or [] if "function" in t}
        self.held = ""  # a possible marker start, or a call's text so far
        self.in_call = False

    def parse_call(self, text: str) -> list[ToolCall] | None:
        """The calls in one call's text (between the markers); None: not a call."""
        raise NotImplementedError

    def feed(self, text: str) -> ParseStep:
        step = ParseStep()
        text, self.held = self.held + text, ""
        while text:
            if not self.in_call:
                at = text.find(self.start)
                if at < 0:
                    keep = partial_suffix(text, self.start)
                    step.content += text[: len(text) - keep]
                    self.held = text[len(text) - keep :]
                    return step
                step.content += text[:at]
                self.in_call, text = True, text[at:]
            if not self.end:  # the call runs to the end of the output
                self.held = text
                return step
            at = text.find(self.end, len(self.start))
            if at < 0:
                self.held = text
                return step
            whole, text = text[: at + len(self.end)], text[at + len(self.end) :]
            self.in_call = False
            calls = self.parse_call(whole[len(self.start) : -len(self.end)])
            if calls is None:
                step.content += whole
            else:
                step.calls += calls
        return step

    def finish(self) -> ParseStep:
        held, self.held = self.held, ""
        if not self.in_call:
            return ParseStep(content=held)
        self.in_call = False
        calls = self.parse_call(held[len(self.start) :].removesuffix(self.end))
        return ParseStep(content=held) if calls is None else ParseStep(calls=calls)

    def parse(self, text: str) -> ParseStep:
        """A whole output at once."""
        step = self.feed(text)
        step += self.finish()
        return step
