"""Structured output from a reasoning model through every service: with --reasoning-parser,
a json_schema response_format constrains only what follows `</think>`, so the model thinks
freely (`reasoning_content`) and `content` is a document valid against the schema.

The tiny random model has `<think>` and `</think>` as single tokens and a template that opens
the thinking part (Qwen3 Thinking-2507's and DeepSeek-R1's format, --reasoning-parser
qwen3-thinking); `</think>`'s logit is raised so that it ends its thinking after a few tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import free_port_block
from tests.e2e.stack import Stack, start_stack
from tests.executor.helpers import EOS_ID
from tests.executor.thinking import THINK_END_ID, write_thinking_model

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = "tiny-thinking"
SCHEMA: Any = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["color", "size"],
    "additionalProperties": False,
}
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
# `</think>` soon; no EOS while thinking (the grammar ends the answer itself)
BIAS = {str(THINK_END_ID): 3, str(EOS_ID): -100}


@pytest.fixture(scope="module")
def thinking_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    path: Path = write_thinking_model(tmp_path_factory.mktemp("thinking"), seed=5)
    stack = start_stack(
        [
            "--model",
            str(path),
            "--served-model-name",
            MODEL,
            "--reasoning-parser",
            "qwen3-thinking",
            "--max-total-tokens",
            "8192",
            "--metrics-port",
            str(free_port_block()),
        ],
        tmp_path_factory.mktemp("logs") / "thinking-stack.log",
        redis_url.rsplit("/", 1)[0] + "/6",
    )
    yield stack
    assert stack.stop() == 0, stack.log_tail()


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)


def test_the_answer_after_thinking_validates(thinking_stack: Stack) -> None:
    thought = 0
    for seed in range(6):
        r = client(thinking_stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a json please"}],
            response_format=FORMAT,
            logit_bias=BIAS,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        out = r.choices[0]
        assert out.finish_reason == "stop", (seed, out)
        reasoning = (out.message.model_extra or {}).get("reasoning_content") or ""
        assert "</think>" not in reasoning and "</think>" not in (out.message.content or "")
        jsonschema.validate(json.loads(out.message.content or ""), SCHEMA)
        thought += bool(reasoning)
    # The thinking parts were free text: the grammar would have refused their first byte.
    assert thought >= 3, thought
    thinking_stack.wait_idle()


def test_with_thinking_off_the_whole_output_is_the_answer(thinking_stack: Stack) -> None:
    """The template closes the thinking part itself: the grammar starts at the first token
    (the raw output is the document, nothing before it)."""
    for seed in range(3):
        r = client(thinking_stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a json please"}],
            response_format=FORMAT,
            logit_bias=BIAS,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
            extra_body={
                "chat_template_kwargs": {"enable_thinking": False},
                "separate_reasoning": False,
            },
        )
        out = r.choices[0]
        assert out.finish_reason == "stop", (seed, out)
        jsonschema.validate(json.loads(out.message.content or ""), SCHEMA)
    thinking_stack.wait_idle()
