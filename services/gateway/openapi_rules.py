"""The ranges, enums and sizes validation.py checks beyond the msgspec types, stated in the
OpenAPI document's body schemas. Numeric and array keywords constrain only values of their
type, so they sit beside a nullable field's `anyOf` unchanged. tests/gateway/test_openapi.py
holds each bound against the validation functions, so the two cannot drift apart silently."""

from __future__ import annotations

from typing import Any

from services.gateway.validation import limits as v

U64 = 2**64
SEED = {"minimum": -(2**63), "maximum": U64 - 1}
LOGPROBS = {"minimum": 0, "maximum": v.MAX_LOGPROBS}
PENALTY = {"minimum": -2, "maximum": 2}
# sampling controls, shared by the OpenAI bodies and /generate's sampling_params
SAMPLING: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "not": {"const": 0}},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "seed": SEED,
    "stop": {"maxItems": v.MAX_STOP_STRINGS},
    "logit_bias": {
        "maxProperties": v.MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]+$"},
    },
    "n": {"minimum": 1, "maximum": v.MAX_N},
}
TOKENS = {"minimum": 1, "maximum": v.MAX_TOKENS_LIMIT}
# 0 on completions and chat, as SGLang takes it: the prompt only (scored, with echo)
PROMPT_ONLY_TOKENS = {"minimum": 0, "maximum": v.MAX_TOKENS_LIMIT}
OPENAI = {**SAMPLING, "max_tokens": PROMPT_ONLY_TOKENS, "min_tokens": {"minimum": 0}}
RULES: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionBody": {
        **OPENAI,
        "prompt": {"minItems": 1, "minLength": 1},
        "logprobs": LOGPROBS,
        "best_of": {"minimum": 1, "maximum": v.MAX_N},
        "suffix": {"maxLength": 0},  # no fill-in-the-middle mode: only "" or null
    },
    "ChatBody": {
        **OPENAI,
        "messages": {"minItems": 1},
        "max_completion_tokens": PROMPT_ONLY_TOKENS,
        "top_logprobs": LOGPROBS,
    },
    "ChatMessageBody": {"role": {"enum": list(v.CHAT_ROLES)}},
    "ResponsesBody": {
        **{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed")},
        "repetition_penalty": SAMPLING["repetition_penalty"],
        "max_output_tokens": TOKENS,
        "input": {"minItems": 1},
    },
    "NativeSamplingBody": {
        **SAMPLING,
        "max_new_tokens": PROMPT_ONLY_TOKENS,
        "min_new_tokens": {"minimum": 0},
        "stop_regex": {"maxItems": v.MAX_STOP_STRINGS, "maxLength": v.MAX_STOP_REGEX_CHARS},
    },
    "GenerateBody": {
        "text": {"minLength": 1, "minItems": 1, "maxItems": v.MAX_BATCH},
        "input_ids": {"minItems": 1},
        "top_logprobs_num": LOGPROBS,
        "logprob_start_len": {"minimum": -1},
    },
    "DetokenizeBody": {"tokens": {"items": {"type": "integer", "minimum": 0}}},
}


def apply(schemas: dict[str, Any]) -> dict[str, Any]:
    """`schemas` (msgspec's components) with RULES merged into their properties."""
    out = dict(schemas)
    for name, fields in RULES.items():
        schema = dict(out[name])
        props = dict(schema["properties"])
        for prop, rule in fields.items():
            props[prop] = {**props[prop], **rule}
        out[name] = {**schema, "properties": props}
    return out
