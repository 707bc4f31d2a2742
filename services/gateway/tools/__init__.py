"""Tool-call parsers: find the function calls in a model's output, in the format its family
writes them, whole or one streamed delta at a time (each a small plug-in, registered in
`PARSERS` under the name --tool-call-parser will take).

    parser = PARSERS["hermes"](tools)
    step = parser.feed(delta_text)      # content to stream now, calls completed by this text
    step = parser.finish()              # at the end: what was held back

Text that turns out not to be a call is never lost: it goes back to the content.
"""

from __future__ import annotations

from services.gateway.tools.base import ParseStep, ToolCall, ToolCallParser
from services.gateway.tools.formats import Hermes, Llama3Json, Mistral, Qwen3CoderXml

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": Hermes,  # Hermes, Qwen2.5, Qwen3: <tool_call>{"name", "arguments"}</tool_call>
    "qwen25": Hermes,
    "llama3_json": Llama3Json,  # Llama 3.1-3.3: {"name", "parameters"} (after <|python_tag|>)
    "mistral": Mistral,  # [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}
    "qwen3_coder": Qwen3CoderXml,  # <tool_call><function=f><parameter=p>v</parameter>...
}

__all__ = ["PARSERS", "ParseStep", "ToolCall", "ToolCallParser"]
