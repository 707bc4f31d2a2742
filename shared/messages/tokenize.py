"""rs:tokenize — requests from a gateway to the tokenizer replicas."""

from __future__ import annotations

import msgspec

from shared.messages.common import Constraint, SamplingParams, Trace


class TextPrompt(msgspec.Struct, tag="text", kw_only=True, frozen=True):
    text: str
    add_special_tokens: bool = True


class TokenPrompt(msgspec.Struct, tag="tokens", kw_only=True, frozen=True):
    input_ids: list[int]


class ChatMessage(msgspec.Struct, kw_only=True, frozen=True):
    role: str
    content: str


class ChatPrompt(msgspec.Struct, tag="chat", kw_only=True, frozen=True):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True


Prompt = TextPrompt | TokenPrompt | ChatPrompt


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True, frozen=True):
    trace: Trace
    prompt: Prompt
    sampling: SamplingParams
    stream: bool = False
    constraint: Constraint | None = None  # structured output (routed through the grammar service)
    echo: bool = False  # send the prompt's text back before the output (OpenAI `echo`)


class AbortRequest(msgspec.Struct, tag="abort", kw_only=True, frozen=True):
    """Stop a request wherever it is; also sent to rs:schedule."""

    rid: str
    reason: str = "abort"


TokenizeMessage = GenerateRequest | AbortRequest
