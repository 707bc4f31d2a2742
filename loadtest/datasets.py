"""Benchmark workloads, each a list of conversations.

A single-prompt request is a conversation of one turn; `multi-turn` has several, and the
runner sends turn k with the earlier turns' prompts and the server's answers before it.
Lengths are in tokens of the benchmark's tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.textgen import TextSource

# The separator between a shared system prompt and its question, and between turns when a
# conversation is flattened into one completion prompt. Starts with whitespace, so the
# tokenizer never merges it into the last token of the text before it.
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Turn:
    user: str  # the new user message of this turn
    user_len: int  # its length in tokens
    output_len: int


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    system: str | None = None  # sent before the first turn (the shared prefix of its group)
    system_len: int = 0
    json_schema: dict[str, Any] | None = None
    # a JSONL line's messages before its last user message, sent as they are
    history: tuple[dict[str, str], ...] = field(default_factory=tuple)
    history_len: int = 0


def uniform_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """n lengths drawn uniformly from [length * range_ratio, length], as SGLang draws them."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"the range ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(n)]


def single(source: TextSource, input_len: int, output_len: int, **kw: Any) -> Conversation:
    return Conversation(turns=(Turn(source.text(input_len), input_len, output_len),), **kw)


def random_dataset(
    source: TextSource,
    rng: random.Random,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
) -> list[Conversation]:
    ins = uniform_lengths(rng, num_prompts, input_len, range_ratio)
    outs = uniform_lengths(rng, num_prompts, output_len, range_ratio)
    return [single(source, i, o) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_dataset(
    source: TextSource,
    rng: random.Random,
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
) -> list[Conversation]:
    """G groups x P prompts: one S-token system prompt per group before each Q-token
    question, shuffled so a group's requests do not arrive back to back."""
    out = []
    for _ in range(num_groups):
        system = source.text(system_len)
        for _ in range(prompts_per_group):
            out.append(
                single(source, question_len, output_len, system=system, system_len=system_len)
            )
    rng.shuffle(out)
    return out


def multi_turn_dataset(
    source: TextSource,
    num_conversations: int,
    num_turns: int,
    turn_input_len: int,
    output_len: int,
) -> list[Conversation]:
    """Each turn adds a fresh `turn_input_len`-token user message; the prompt of turn k holds
    turns 0..k-1 and their answers, which only exist at run time."""

    def turn() -> Turn:
        return Turn(source.text(turn_input_len), turn_input_len, output_len)

    return [
        Conversation(turns=tuple(turn() for _ in range(num_turns)))
        for _ in range(num_conversations)
    ]


# Structured-output targets: a schema and what to ask for, picked per request.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person mentioned in the text",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "occupation": {"type": "string"},
            },
            "required": ["name", "age", "occupation"],
        },
    ),
    (
        "the places in the text",
        {
            "type": "object",
            "properties": {
                "places": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                "count": {"type": "integer"},
            },
            "required": ["places", "count"],
        },
    ),
    (
        "the mood of the text",
        {
            "type": "object",
            "properties": {
                "mood": {"type": "string", "enum": ["calm", "tense", "sad", "joyful"]},
                "confidence": {"type": "number"},
                "summary": {"type": "string"},
            },
            "required": ["mood", "confidence", "summary"],
        },
    ),
]


def json_dataset(
    source: TextSource,
    rng: random.Random,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
) -> list[Conversation]:
    """Random-text prompts that ask for a JSON object matching a schema (structured output)."""
    ins = uniform_lengths(rng, num_prompts, input_len, range_ratio)
    outs = uniform_lengths(rng, num_prompts, output_len, range_ratio)
    out = []
    for i, o in zip(ins, outs, strict=True):
        what, schema = rng.choice(SCHEMAS)
        ask = f"{SEPARATOR}Answer with a JSON object describing {what}."
        body_len = max(1, i - source.count(ask))
        turn = Turn(source.text(body_len) + ask, body_len + source.count(ask), o)
        out.append(Conversation(turns=(turn,), json_schema=schema))
    return out


def jsonl_dataset(
    path: Path, source: TextSource, num_prompts: int, default_output_len: int
) -> list[Conversation]:
    """Lines `{"prompt": str, "output_len": int?}` or `{"messages": [...], "output_len": int?}`;
    the first `num_prompts` lines (all of them when num_prompts <= 0)."""
    out: list[Conversation] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if 0 < num_prompts <= len(out):
                break
            out.append(
                _jsonl_line(json.loads(line), source, default_output_len, f"{path}:{lineno}")
            )
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def _jsonl_line(
    obj: dict[str, Any], source: TextSource, default_output_len: int, where: str
) -> Conversation:
    output_len = int(obj.get("output_len", default_output_len))
    if "prompt" in obj:
        prompt = str(obj["prompt"])
        return Conversation(turns=(Turn(prompt, source.count(prompt), output_len),))
    messages = obj.get("messages")
    if not messages or messages[-1].get("role") != "user":
        raise ValueError(f"{where}: need 'prompt', or 'messages' ending with a user message")
    *history, last = ({"role": m["role"], "content": str(m["content"])} for m in messages)
    system = None
    if history and history[0]["role"] == "system":
        system = history.pop(0)["content"]
    return Conversation(
        turns=(Turn(last["content"], source.count(last["content"]), output_len),),
        system=system,
        system_len=source.count(system) if system is not None else 0,
        history=tuple(history),
        history_len=sum(source.count(m["content"]) for m in history),
    )
