"""The SGLang paper's frontend workloads, written in radixserve.lang (their shapes, our text):

- few_shot: multiple choice with `select`: a shared 5-shot prefix, a question, 4 choices.
- tot: tree-of-thought style branching with `fork`: depth 3, width 3 (39 generations).
- multi_turn: a chat of 4 turns, each a user message and a generated assistant answer.

The text is drawn from a fixed word list with a seeded generator, so every run of a workload
sends the same programs. What matters for the runtime is the structure: how much of each
prompt is shared, and how the generations depend on one another.
"""

from __future__ import annotations

import random
from typing import Any

import radixserve.lang as rl

WORDS = (  # noqa: SIM905 (a word list reads better as text)
    "river stone light garden signal market winter paper engine harbor orbit silver "
    "lantern meadow circuit forest canvas thunder mirror ladder copper island "
    "pattern valley rocket anchor crystal whisper compass summit ember quartz shadow "
    "voyage"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


# -- few-shot multiple choice ------------------------------------------------------------------
def few_shot_prefix(rng: random.Random, shots: int = 5) -> str:
    parts = []
    for _ in range(shots):
        choices = [sentence(rng, 4) for _ in range(4)]
        lines = [f"Question: {sentence(rng, 24)}"]
        lines += [f"{'ABCD'[i]}. {c}" for i, c in enumerate(choices)]
        lines.append(f"Answer: {rng.choice('ABCD')}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n\n"


@rl.function
def few_shot(s: Any, prefix: str, question: str, choices: list[str]) -> None:
    s += prefix + f"Question: {question}\n"
    s += "".join(f"{'ABCD'[i]}. {c}\n" for i, c in enumerate(choices))
    s += "Answer: " + rl.select("answer", ["A", "B", "C", "D"])


def few_shot_jobs(rng: random.Random, programs: int) -> list[dict[str, Any]]:
    prefix = few_shot_prefix(rng)
    return [
        {
            "prefix": prefix,
            "question": sentence(rng, 24),
            "choices": [sentence(rng, 4) for _ in range(4)],
        }
        for _ in range(programs)
    ]


# -- tree of thought ---------------------------------------------------------------------------
def _expand(s: Any, depth: int, width: int, tokens: int) -> None:
    if depth == 0:
        return
    branches = s.fork(width)
    branches += lambda i: f"\nThought {i + 1}:"
    branches += rl.gen("thought", max_tokens=tokens, ignore_eos=True)
    for branch in branches:
        _expand(branch, depth - 1, width, tokens)
    branches.join()


@rl.function
def tree_of_thought(s: Any, problem: str, depth: int, width: int, tokens: int) -> None:
    s += f"Problem: {problem}\nLet us think in steps, trying several ideas at each step."
    _expand(s, depth, width, tokens)


def tot_jobs(rng: random.Random, programs: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {"problem": sentence(rng, 48), "depth": 3, "width": 3, "tokens": tokens}
        for _ in range(programs)
    ]


# -- multi-turn chat ---------------------------------------------------------------------------
@rl.function
def multi_turn(s: Any, system: str, questions: list[str], tokens: int) -> None:
    s += rl.system(system)
    for i, question in enumerate(questions):
        s += rl.user(question)
        s += rl.assistant(rl.gen(f"answer{i}", max_tokens=tokens, ignore_eos=True))


def multi_turn_jobs(rng: random.Random, programs: int, tokens: int) -> list[dict[str, Any]]:
    system = " ".join(sentence(rng, 16) for _ in range(6))
    return [
        {
            "system": system,
            "questions": [sentence(rng, 20) for _ in range(4)],
            "tokens": tokens,
        }
        for _ in range(programs)
    ]
