"""The `<think>...</think>` formats. A splitter holds back only what may still turn out to be
part of a tag (a delta ending in "</th" waits for the next), so every character goes out
exactly once, on the side it belongs to, whatever the delta boundaries.

- qwen3: the model opens its thinking itself; an output that does not start with `<think>`
  (thinking off: the template wrote an empty block into the prompt) is all answer.
- deepseek-r1: the template opens the block, so the output is thinking until `</think>` (a
  leading `<think>`, which some versions still emit, is dropped); an output that never closes
  it is all thinking.

The answer's leading newlines (the models put "\\n\\n" after `</think>`) are dropped.

With `stream_reasoning=False` (SGLang's field of that name) the thinking part is held back
and released whole, in the delta where it ends.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    # Where an output that does not begin with START belongs.
    unopened_is_reasoning = False
    # What closes the thinking part: a constrained chat request's grammar starts after it.
    end_tag = END

    def __init__(self, stream_reasoning: bool = True) -> None:
        self.state = "start"  # start -> reasoning -> answer_start -> answer
        self.held = ""
        self.stream_reasoning = stream_reasoning
        self.pending = ""  # thinking held back until it ends (stream_reasoning false)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of `text`, after what was held back before it."""
        reasoning: list[str] = []
        content: list[str] = []
        text, self.held = self.held + text, ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self.state, text = "reasoning", stripped[len(START) :]
                elif START.startswith(stripped):  # whitespace, or "<thi": wait and see
                    self.held = text
                    return "".join(reasoning), "".join(content)
                else:
                    self.state = "reasoning" if self.unopened_is_reasoning else "answer"
            elif self.state == "reasoning":
                at = text.find(END)
                if at >= 0:
                    reasoning.append(text[:at])
                    self.state, text = "answer_start", text[at + len(END) :]
                else:
                    keep = _partial_suffix(text, END)
                    reasoning.append(text[: len(text) - keep])
                    self.held = text[len(text) - keep :]
                    text = ""
            elif self.state == "answer_start":
                text = text.lstrip("\n")
                if text:
                    self.state = "answer"
            else:
                content.append(text)
                text = ""
        return self._released("".join(reasoning)), "".join(content)

    def _released(self, reasoning: str) -> str:
        """The thinking to send now: all of it when streamed, else the whole once it ended."""
        if self.stream_reasoning:
            return reasoning
        self.pending += reasoning
        if self.state in ("start", "reasoning"):
            return ""
        out, self.pending = self.pending, ""
        return out

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete."""
        held, self.held = self.held, ""
        pending, self.pending = self.pending, ""
        if self.state == "reasoning" or (self.state == "start" and self.unopened_is_reasoning):
            return pending + held, ""
        return pending, held

    def split(self, text: str) -> tuple[str, str]:
        """A whole output at once."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2


class Qwen3(ThinkSplitter):
    unopened_is_reasoning = False


class DeepSeekR1(ThinkSplitter):
    unopened_is_reasoning = True
