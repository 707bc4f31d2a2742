"""rs:tokenize — requests from a gateway to the tokenizer replicas.

GenerateRequest starts a generation; TokenizeRequest and DetokenizeRequest are calls the
tokenizer answers at once on the gateway's reply stream (POST /tokenize, /detokenize), so the
gateway never loads the tokenizer itself.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.messages.common import AbortRequest, Constraint, SamplingParams, Trace


class TextPrompt(msgspec.Struct, tag="text", kw_only=True, frozen=True):
    text: str
    add_special_tokens: bool = True


class TokenPrompt(msgspec.Struct, tag="tokens", kw_only=True, frozen=True):
    input_ids: list[int]


class ChatMessage(msgspec.Struct, kw_only=True, frozen=True):
    role: str
    content: str
    # an assistant's calls, as templates take them ({"id", "type", "function": {"name",
    # "arguments": {...}}}), and a tool message's answer to one
    tool_calls: list[dict[str, Any]] = []
    tool_call_id: str = ""
    name: str = ""


class ChatPrompt(msgspec.Struct, tag="chat", kw_only=True, frozen=True):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    # the output continues the last (assistant) message: no generation prompt, no end of turn
    continue_final_message: bool = False
    # extra variables for the template (chat_template_kwargs, reasoning_effort): JSON values
    template_kwargs: dict[str, Any] = {}
    tools: list[dict[str, Any]] = []  # the request's tools, for the template to show


Prompt = TextPrompt | TokenPrompt | ChatPrompt


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True, frozen=True):
    trace: Trace
    prompt: Prompt
    sampling: SamplingParams
    stream: bool = False
    constraint: Constraint | None = None  # structured output (routed through the grammar service)
    echo: bool = False  # send the prompt's text back before the output (OpenAI `echo`)
    # whose field names a refusal uses: "openai" (max_tokens, prompt, ...), "native"
    # (/generate's sampling_params.max_new_tokens, text, ...), "responses" (input,
    # max_output_tokens) or "embeddings" (input)
    api: str = "openai"
    # --reasoning-parser, on a constrained chat request: the text that ends the model's thinking
    # part ("</think>"). Unless the rendered prompt already closed that part (Qwen3's
    # enable_thinking false), the tokenizer resolves it to TokenizedRequest.think_end_id and the
    # constraint starts after it. "": the constraint starts at the first token.
    think_end: str = ""
    # A /v1/embeddings input: the prompt is computed and pooled into a vector (the executor's
    # --is-embedding pooling); nothing is generated (sampling.max_new_tokens is 0).
    embed: bool = False
    dimensions: int = 0  # embeddings: keep the first n values, renormalised (Matryoshka); 0: all


class TokenizeRequest(msgspec.Struct, tag="tokenize", kw_only=True, frozen=True):
    """The token ids of a prompt, answered with a `reply.TokenizeResult` (or a Failure).
    No length check: the client asks in order to check lengths itself."""

    trace: Trace
    prompt: TextPrompt | ChatPrompt


class DetokenizeRequest(msgspec.Struct, tag="detokenize", kw_only=True, frozen=True):
    """The text of token ids, answered with a `reply.DetokenizeResult` (or a Failure naming
    the first id outside the vocabulary)."""

    trace: Trace
    token_ids: list[int]
    skip_special_tokens: bool = False


TokenizeMessage = GenerateRequest | AbortRequest | TokenizeRequest | DetokenizeRequest
