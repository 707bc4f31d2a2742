"""Reasoning parsers (--reasoning-parser): split a reasoning model's output into its thinking
part (`reasoning_content`) and its answer (`content`), whole or one streamed delta at a time.

    splitter = PARSERS["qwen3"]()
    reasoning, content = splitter.feed(delta_text)   # as deltas arrive
    reasoning, content = splitter.finish()           # what it held back at the end
"""

from __future__ import annotations

from services.gateway.reasoning.think import DeepSeekR1, Qwen3, ThinkSplitter

PARSERS: dict[str, type[ThinkSplitter]] = {
    "qwen3": Qwen3,
    "deepseek-r1": DeepSeekR1,
    # Qwen3's "Thinking-2507" models: their template opens the block, as DeepSeek-R1's does
    "qwen3-thinking": DeepSeekR1,
}

__all__ = ["PARSERS", "ThinkSplitter"]
