"""Tool-call parsers (services/gateway/tools): each format's calls found in hand-written
outputs, and the same calls and content however the output is split into streamed deltas."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from services.gateway.tools import PARSERS, ToolCall

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
TOOLS = [WEATHER]
PARIS = ToolCall("weather", json.dumps({"city": "Paris", "days": 2}))
ROME = ToolCall("weather", json.dumps({"city": "Rome"}))

NOT_A_CALL = "no call, only <tool talk> and </tool_call>"
BAD_JSON = "<tool_call>{not json}</tool_call> after"
# (format, output, content, calls)
CASES: list[tuple[str, str, str, list[ToolCall]]] = [
    (
        "hermes",
        'Checking. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}'
        '\n</tool_call>\n<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n'
        "</tool_call>",
        "Checking. \n",
        [PARIS, ROME],
    ),
    (
        "hermes",
        "no call, only <tool talk> and </tool_call>",
        "no call, only <tool talk> and </tool_call>",
        [],
    ),
    (
        "hermes",  # the model stopped before closing its call
        '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}',
        "",
        [ROME],
    ),
    (
        "hermes",
        "<tool_call>{not json}</tool_call> after",
        "<tool_call>{not json}</tool_call> after",
        [],
    ),
    ("hermes", "cut short <tool_ca", "cut short <tool_ca", []),
    (
        "mistral",
        'Sure[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "weather", "arguments": {"city": "Rome"}}]',
        "Sure",
        [PARIS, ROME],
    ),
    (
        "mistral",
        '[TOOL_CALLS]weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]weather[ARGS]'
        '{"city": "Rome"}',
        "",
        [PARIS, ROME],
    ),
    ("mistral", "[TOOL_CALLS]broken", "[TOOL_CALLS]broken", []),
    (
        "llama3_json",
        '{"name": "weather", "parameters": {"city": "Paris", "days": 2}}; '
        '{"name": "weather", "parameters": {"city": "Rome"}}',
        "",
        [PARIS, ROME],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Rome"}}',
        "",
        [ROME],
    ),
    ("llama3_json", ' {"not": "a call"}', ' {"not": "a call"}', []),
    ("llama3_json", "It is {sunny} today.", "It is {sunny} today.", []),
    (
        "qwen3_coder",
        "Let me see.\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "Let me see.\n",
        [PARIS],
    ),
    (
        "qwen3_coder",
        "<tool_call><function=weather><parameter=city>Rome</parameter></function></tool_call>"
        "<tool_call>oops</tool_call>",
        "<tool_call>oops</tool_call>",
        [ROME],
    ),
]


def ids(case: tuple[str, str, str, list[ToolCall]]) -> str:
    return f"{case[0]}-{CASES.index(case)}"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_whole_outputs(case: tuple[str, str, str, list[ToolCall]]) -> None:
    name, output, content, calls = case
    step = PARSERS[name](TOOLS).parse(output)
    assert (step.content, step.calls) == (content, calls)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_every_streaming_split_finds_the_same(case: tuple[str, str, str, list[ToolCall]]) -> None:
    name, output, content, calls = case
    cuts = range(len(output) + 1)
    for a, b in itertools.combinations(cuts, 2):
        parser = PARSERS[name](TOOLS)
        got_content, got_calls = "", []
        for piece in (output[:a], output[a:b], output[b:]):
            step = parser.feed(piece)
            got_content += step.content
            got_calls += step.calls
        step = parser.finish()
        got_content += step.content
        got_calls += step.calls
        assert (got_content, got_calls) == (content, calls), (output[:a], output[a:b])


def test_a_call_goes_out_as_soon_as_it_closes() -> None:
    parser = PARSERS["hermes"](TOOLS)
    first = parser.feed('<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert first.calls == [ROME]
    assert parser.feed("<tool_call>").calls == []


def test_no_marker_prefix_leaks_into_content() -> None:
    parser = PARSERS["hermes"](TOOLS)
    streamed: list[Any] = [parser.feed(c).content for c in "ab<tool_"]
    assert "".join(streamed) == "ab"  # "<tool_" waits: it may open a call
