"""Reasoning parsers (--reasoning-parser): split a reasoning model's output into its thinking
part (`reasoning_content`) and its answer (`content`), whole or one streamed delta at a time.

    splitter = PARSERS["qwen3"]()
    reasoning, content = splitter.feed(delta_text)   # as deltas arrive
    reasoning, content = splitter.finish()           # what it held back at the end

`think_end(name)` is the parser's end tag, which the gateway sends with constrained chat
requests: their grammar starts once the model has written it (see TokenizedRequest.think_end_id).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from services.gateway.reasoning.think import DeepSeekR1, Qwen3, ThinkSplitter

PARSERS: dict[str, type[ThinkSplitter]] = {
    "qwen3": Qwen3,
    "deepseek-r1": DeepSeekR1,
    # Qwen3's "Thinking-2507" models: their template opens the block, as DeepSeek-R1's does
    "qwen3-thinking": DeepSeekR1,
}


def splitter_for(
    parser: str, template_kwargs: dict[str, Any], stream_reasoning: bool = True
) -> Callable[[], ThinkSplitter] | None:
    """What makes the splitter of a chat request under --reasoning-parser `parser`; None where
    there is none, or where the request turned thinking off through the template's own switch
    (`enable_thinking: false`, Qwen3's; `thinking: false`, DeepSeek-V3.1's): the whole output
    is then the answer, as SGLang reads it, even under a parser whose output starts inside
    the thinking part."""
    if not parser:
        return None
    if template_kwargs.get("enable_thinking") is False or template_kwargs.get("thinking") is False:
        return None
    return partial(PARSERS[parser], stream_reasoning=stream_reasoning)


def think_end(parser: str) -> str:
    """The text that ends the thinking part under --reasoning-parser `parser` ("": none)."""
    return PARSERS[parser].end_tag if parser else ""


__all__ = ["PARSERS", "ThinkSplitter", "splitter_for", "think_end"]
