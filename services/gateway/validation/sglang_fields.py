"""Request fields of SGLang's API (and some of vLLM's and OpenAI's) that radixserve does not
act on (protocol.SGLangFields, the rest of /generate's, StructuredOutputs', ChatBody's): each
passes at its "off" value, which SGLang's own clients send by default, and is refused by name,
with the reason, when it asks for something."""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.errors import invalid

_NO_LORA = "this server serves one model, without LoRA adapters"
_NO_DISAGG = "this server does not split prefill and decode across servers"
_TEXT_ONLY = "the served model reads text only"
_WHITESPACE = "JSON output takes the whitespace the grammar backend allows"
_FUNCTIONS = "OpenAI's deprecated function calling; send tools (and tool_choice)"

# field -> why it cannot be honoured
REASONS: dict[str, str] = {
    "lora_path": _NO_LORA,
    "lora_id": _NO_LORA,
    "return_hidden_states": "hidden states are not returned",
    "session_params": "there are no stateful sessions; send the whole conversation",
    "custom_logit_processor": "this server runs no client code",
    "custom_params": "it feeds custom logit processors, which this server does not run",
    "bootstrap_host": _NO_DISAGG,
    "bootstrap_port": _NO_DISAGG,
    "bootstrap_room": _NO_DISAGG,
    "bootstrap_pair_key": _NO_DISAGG,
    "extra_key": "every request shares the prefix cache",
    "cache_salt": "every request shares the prefix cache",
    "priority": "requests are scheduled in arrival order",
    "custom_labels": "metrics carry no per-request labels",
    "image_data": _TEXT_ONLY,
    "video_data": _TEXT_ONLY,
    "audio_data": _TEXT_ONLY,
    "input_embeds": "prompts are text or token ids",
    "modalities": _TEXT_ONLY,
    "token_ids_logprob": "ask for top_logprobs_num instead",
    "data_parallel_rank": "the scheduler chooses the executor (by prefix-cache affinity)",
    "background": "requests are answered while the client waits",
    "return_bytes": "texts are returned as strings",
    "return_entropy": "the sampling distribution's entropy is not returned",
    "structural_tag": "use json_schema, regex or ebnf",
    # OpenAI's
    "audio": "the served model writes text only",
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "verbosity": "the served model has no verbosity setting; say so in the messages",
    "web_search_options": "this server has no web search",
    # vLLM's
    "guided_whitespace_pattern": _WHITESPACE,
    "whitespace_pattern": _WHITESPACE,
    "disable_any_whitespace": _WHITESPACE,
    "disable_additional_properties": "a JSON schema's additionalProperties decides",
}


def is_off(value: Any) -> bool:
    """None, false, or a list (one per prompt of a batch) of them."""
    if isinstance(value, list):
        return all(is_off(v) for v in value)
    return value is None or value is False


def _text_only(value: Any) -> bool:
    return isinstance(value, list) and all(v == "text" for v in value)


# Fields with an "off" value of their own: modalities ["text"] asks for nothing more
OFF_TOO = {"modalities": _text_only}


def refuse_unsupported(body: msgspec.Struct, prefix: str = "") -> None:
    """A 400 naming the first of `body`'s fields in REASONS that is not off."""
    for name in body.__struct_fields__:
        reason = REASONS.get(name)
        value = getattr(body, name)
        if reason is not None and not (is_off(value) or OFF_TOO.get(name, is_off)(value)):
            param = prefix + name
            raise invalid(f"{param} is not supported: {reason}", param)
