"""The body of POST /v1/responses (the fields radixserve serves; any other is a 400)."""

from __future__ import annotations

from typing import Any

import msgspec


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`text.format`: "text", "json_object", or "json_schema" with its schema inline."""

    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # accepted; a schema is always enforced


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; the model decides its length


class ReasoningConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None  # reaches the chat template as reasoning_effort
    summary: str | None = None  # accepted; the reasoning is returned whole, not summarised


class ResponsesBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    # a string (one user message) or a list of input items: messages, and a tool loop's
    # function_call and function_call_output items (convert.py)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # function tools, flat: {"type": "function", "name", "description", "parameters", "strict"}
    tools: list[dict[str, Any]] | None = None
    # "none", "auto" (needs --tool-call-parser), "required" or {"type": "function", "name"}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # accepted; responses are never stored (see README)
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    # extensions that the chat endpoint takes too (the openai client's extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
