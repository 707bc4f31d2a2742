"""Validation without Redis or HTTP: bodies -> Jobs, and refusals naming the field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from services.gateway.errors import ApiError, from_decode_error
from services.gateway.protocol import ChatBody, CompletionBody, GenerateBody
from services.gateway.validation import chat_job, completion_job, decode, native_job
from shared.messages.common import (
    ChoiceConstraint,
    EbnfConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
)
from shared.messages.tokenize import ChatMessage, ChatPrompt, TextPrompt, TokenPrompt

MODEL = "m"


def refusal(body: bytes, type_: type, model: str = MODEL) -> ApiError:
    with pytest.raises(ApiError) as e:
        parsed: Any = decode(body, type_)
        if type_ is CompletionBody:
            completion_job(parsed, model)
        elif type_ is ChatBody:
            chat_job(parsed, model)
        else:
            native_job(parsed)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("Expected `int`, got `str` - at `$.max_tokens`", "max_tokens"),
        ("Object missing required field `prompt`", "prompt"),
        ("Object missing required field `role` - at `$.messages[0]`", "messages[0].role"),
        ("Object contains unknown field `x` - at `$.sampling_params`", "sampling_params.x"),
        ("Expected `object`, got `array`", None),
    ],
)
def test_decode_error_names_the_field(message: str, param: str | None) -> None:
    error = from_decode_error(msgspec.ValidationError(message))
    assert (error.status, error.param, error.message) == (400, param, message)


def test_malformed_json() -> None:
    error = refusal(b"{nope", CompletionBody)
    assert error.param is None and error.message.startswith("invalid JSON: ")


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ('"hi"', TextPrompt(text="hi")),
        ("[1, 2]", TokenPrompt(input_ids=[1, 2])),
        ('["hi"]', TextPrompt(text="hi")),
        ("[[3, 4]]", TokenPrompt(input_ids=[3, 4])),
    ],
)
def test_completion_prompt_forms(prompt: str, expected: object) -> None:
    job = completion_job(decode(b'{"prompt": %s}' % prompt.encode(), CompletionBody), MODEL)
    assert job.prompt == expected


@pytest.mark.parametrize("prompt", ['[1, "a"]', "[[1], [2]]", "[[]]"])
def test_completion_prompt_refusals(prompt: str) -> None:
    assert refusal(b'{"prompt": %s}' % prompt.encode(), CompletionBody).param == "prompt"


def test_chat_job() -> None:
    body = (
        b'{"messages": [{"role": "system", "content": "s"},'
        b' {"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]},'
        b' {"role": "assistant", "content": null}, {"role": "user", "content": "c"}],'
        b' "max_tokens": 5, "max_completion_tokens": 9, "stream": true,'
        b' "stream_options": {"include_usage": true}, "model": "m"}'
    )
    job = chat_job(decode(body, ChatBody), MODEL)
    assert job.prompt == ChatPrompt(
        messages=[
            ChatMessage(role="system", content="s"),
            ChatMessage(role="user", content="a\nb"),
            ChatMessage(role="assistant", content=""),
            ChatMessage(role="user", content="c"),
        ]
    )
    assert job.sampling == SamplingParams(max_new_tokens=9)
    assert job.stream and job.include_usage


def test_native_defaults_follow_sglang() -> None:
    job = native_job(decode(b'{"text": "x", "sampling_params": {"stop": "END"}}', GenerateBody))
    assert job.sampling == SamplingParams(max_new_tokens=128, stop=["END"])
    assert (job.stream, job.rid) == (False, None)
    unbounded = native_job(
        decode(b'{"text": "x", "sampling_params": {"max_new_tokens": null}}', GenerateBody)
    )
    assert unbounded.sampling.max_new_tokens is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "a", "temperature": 1e999}', "temperature"),
        (b'{"prompt": "a", "min_tokens": 20, "max_tokens": 10}', "min_tokens"),
        (b'{"prompt": "a", "stop": ["x", ""]}', "stop"),
        (b'{"prompt": "a", "stop_token_ids": [-1]}', "stop_token_ids[0]"),
        (b'{"prompt": "a", "best_of": 2}', "best_of"),
        (b'{"prompt": "a", "logit_bias": {"5": 1.0}}', "logit_bias"),
        (b'{"prompt": "a", "repetition_penalty": 1.2}', "repetition_penalty"),
        (b'{"prompt": "a", "seed": 99999999999999999999999}', "seed"),
    ],
)
def test_completion_refusals(body: bytes, param: str) -> None:
    assert refusal(body, CompletionBody).param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            b'{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}',
            "tools",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}',
            "tool_choice",
        ),
        (
            b'{"messages": [{"role": "assistant", "content": "a", "tool_calls": [{}]}]}',
            "messages[0].tool_calls",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "frequency_penalty": 1}',
            "frequency_penalty",
        ),
    ],
)
def test_chat_refusals(body: bytes, param: str) -> None:
    assert refusal(body, ChatBody).param == param


def test_neutral_values_of_unsupported_parameters_pass() -> None:
    body = (
        b'{"messages": [{"role": "user", "content": "a"}], "presence_penalty": 0, "n": 1,'
        b' "logprobs": false, "tool_choice": "none", "response_format": {"type": "text"},'
        b' "logit_bias": {}, "repetition_penalty": 1.0, "user": "u"}'
    )
    assert chat_job(decode(body, ChatBody), MODEL).sampling == SamplingParams()


# --- structured output ---

CHAT = b'{"messages": [{"role": "user", "content": "a"}], "response_format": %s}'


@pytest.mark.parametrize(
    ("fmt", "constraint"),
    [
        (b'{"type": "text"}', None),
        (b"null", None),
        (
            b'{"type": "json_object"}',
            JsonSchemaConstraint(schema='{"type": "object"}', param="response_format"),
        ),
        (
            b'{"type": "json_schema", "json_schema": {"name": "person", "strict": true,'
            b' "schema": {"type": "object", "properties": {"z": {}, "a": {}}}}}',
            JsonSchemaConstraint(
                schema='{"type":"object","properties":{"z":{},"a":{}}}',  # key order kept
                param="response_format.json_schema.schema",
            ),
        ),
    ],
)
def test_response_format(fmt: bytes, constraint: object) -> None:
    assert chat_job(decode(CHAT % fmt, ChatBody), MODEL).constraint == constraint
    completion = b'{"prompt": "a", "response_format": %s}' % fmt
    assert completion_job(decode(completion, CompletionBody), MODEL).constraint == constraint


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        (b'{"type": "yaml"}', "response_format.type"),
        (b"{}", "response_format.type"),
        (b'"json_object"', "response_format"),
        (b'{"type": "json_object", "schema": {}}', "response_format.schema"),
        (b'{"type": "json_schema"}', "response_format.json_schema"),
        (
            b'{"type": "json_schema", "json_schema": {"schema": {}}}',
            "response_format.json_schema.name",
        ),
        (
            b'{"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}',
            "response_format.json_schema.name",
        ),
        (
            b'{"type": "json_schema", "json_schema": {"name": "n"}}',
            "response_format.json_schema.schema",
        ),
        (
            b'{"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}}',
            "response_format.json_schema.schema",
        ),
        (
            b'{"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "x": 1}}',
            "response_format.json_schema.x",
        ),
    ],
)
def test_malformed_response_format_names_the_field(fmt: bytes, param: str) -> None:
    assert refusal(CHAT % fmt, ChatBody).param == param


@pytest.mark.parametrize(
    ("params", "constraint"),
    [
        (
            b'{"json_schema": "{\\"type\\": \\"integer\\"}"}',
            JsonSchemaConstraint(schema='{"type": "integer"}', param="sampling_params.json_schema"),
        ),
        (
            b'{"json_schema": {"type": "array", "items": {"type": "string"}}}',
            JsonSchemaConstraint(
                schema='{"type":"array","items":{"type":"string"}}',
                param="sampling_params.json_schema",
            ),
        ),
        (b'{"regex": "[0-9]+"}', RegexConstraint(pattern="[0-9]+", param="sampling_params.regex")),
        (
            b'{"ebnf": "root ::= \\"a\\""}',
            EbnfConstraint(grammar='root ::= "a"', param="sampling_params.ebnf"),
        ),
        (
            b'{"choices": ["yes", "no", ""]}',
            ChoiceConstraint(choices=["yes", "no", ""], param="sampling_params.choices"),
        ),
        (b"{}", None),
    ],
)
def test_native_constraints(params: bytes, constraint: object) -> None:
    body = b'{"text": "x", "sampling_params": %s}' % params
    assert native_job(decode(body, GenerateBody)).constraint == constraint


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        (b'{"regex": "a", "ebnf": "root ::= \\"a\\""}', "sampling_params.ebnf", "at most one"),
        (b'{"choices": ["a"], "json_schema": {}}', "sampling_params.choices", "at most one"),
        (b'{"regex": ""}', "sampling_params.regex", "must not be empty"),
        (b'{"ebnf": "  "}', "sampling_params.ebnf", "must not be empty"),
        (b'{"json_schema": ""}', "sampling_params.json_schema", "must not be empty"),
        (b'{"json_schema": 3}', "sampling_params.json_schema", "Expected `str | object"),
        (b'{"choices": []}', "sampling_params.choices", "1 to 1024"),
        (b'{"choices": "a"}', "sampling_params.choices", "Expected `array"),
        (b'{"choices": ["a", 1]}', "sampling_params.choices[1]", "Expected `str`"),
        (b'{"regex": "%s"}' % (b"a" * 300_000), "sampling_params.regex", "at most"),
    ],
)
def test_native_constraint_refusals(params: bytes, param: str, words: str) -> None:
    error = refusal(b'{"text": "x", "sampling_params": %s}' % params, GenerateBody)
    assert error.param == param and words in error.message, error.message
