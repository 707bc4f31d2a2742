"""Validation without Redis or HTTP: bodies -> Jobs, and refusals naming the field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from services.gateway.errors import ApiError, from_decode_error
from services.gateway.protocol import (
    ChatBody,
    CompletionBody,
    GenerateBody,
    NativeSamplingBody,
    StructuredOutputs,
)
from services.gateway.validation import (
    Job,
    chat_job,
    completion_jobs,
    decode,
    native_jobs,
    samples,
)
from services.gateway.validation.sglang_fields import REASONS
from shared.messages.common import (
    ChoiceConstraint,
    EbnfConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
)
from shared.messages.tokenize import ChatMessage, ChatPrompt, TextPrompt, TokenPrompt

MODEL = "m"


def completion_job(body: CompletionBody, model: str) -> Job:
    jobs = completion_jobs(body, model)
    assert len(jobs) == 1
    return jobs[0]


def native_job(body: GenerateBody) -> Job:
    jobs, many = native_jobs(body)
    assert len(jobs) == 1 and not many
    return jobs[0]


def refusal(body: bytes, type_: type, model: str = MODEL) -> ApiError:
    with pytest.raises(ApiError) as e:
        parsed: Any = decode(body, type_)
        if type_ is CompletionBody:
            completion_job(parsed, model)
        elif type_ is ChatBody:
            chat_job(parsed, model)
        else:
            native_jobs(parsed)
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


@pytest.mark.parametrize(
    ("prompt", "param"),
    [('[1, "a"]', "prompt[0]"), ("[[1], []]", "prompt[1]"), ("[]", "prompt"), ('""', "prompt")],
)
def test_completion_prompt_refusals(prompt: str, param: str) -> None:
    assert refusal(b'{"prompt": %s}' % prompt.encode(), CompletionBody).param == param


def test_completion_batch_of_prompts() -> None:
    body = decode(b'{"prompt": ["a", [5, 6]], "n": 2, "echo": true}', CompletionBody)
    jobs = completion_jobs(body, MODEL)
    assert [j.prompt for j in jobs] == [TextPrompt(text="a"), TokenPrompt(input_ids=[5, 6])]
    assert all(j.echo for j in jobs)


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
        (b'{"prompt": "a", "top_p": 1e999}', "top_p"),
        (b'{"prompt": "a", "top_p": -1e999}', "top_p"),
        (b'{"prompt": "a", "min_p": -1e999}', "min_p"),
        (b'{"prompt": "a", "frequency_penalty": 1e999}', "frequency_penalty"),
        (b'{"prompt": "a", "logit_bias": {"5": -1e999}}', "logit_bias[...]"),
        (b'{"prompt": "a", "min_tokens": 20, "max_tokens": 10}', "min_tokens"),
        (b'{"prompt": "a", "stop": ["x", ""]}', "stop"),
        (b'{"prompt": "a", "stop_token_ids": [-1]}', "stop_token_ids[0]"),
        (b'{"prompt": "a", "best_of": 0}', "best_of"),
        (b'{"prompt": "a", "n": 3, "best_of": 2}', "best_of"),
        (b'{"prompt": "a", "best_of": 17}', "best_of"),
        (b'{"prompt": "a", "best_of": 2, "stream": true}', "best_of"),
        (b'{"prompt": "a", "logit_bias": {"x": 1.0}}', "logit_bias"),
        (b'{"prompt": "a", "logit_bias": {"-3": 1.0}}', "logit_bias"),
        (b'{"prompt": "a", "logit_bias": {"5": 101}}', "logit_bias[5]"),
        (b'{"prompt": "a", "repetition_penalty": 2.5}', "repetition_penalty"),
        (b'{"prompt": "a", "repetition_penalty": 0}', "repetition_penalty"),
        (b'{"prompt": "a", "presence_penalty": -2.1}', "presence_penalty"),
        (b'{"prompt": "a", "frequency_penalty": 2.1}', "frequency_penalty"),
        (b'{"prompt": "a", "top_p": 0}', "top_p"),
        (b'{"prompt": "a", "top_p": 1.5}', "top_p"),
        (b'{"prompt": "a", "top_k": 0}', "top_k"),
        (b'{"prompt": "a", "top_k": -2}', "top_k"),
        (b'{"prompt": "a", "min_p": 1.5}', "min_p"),
        (b'{"prompt": "a", "temperature": -0.5}', "temperature"),
        (b'{"prompt": "a", "max_tokens": -1}', "max_tokens"),
        (b'{"prompt": "a", "n": 0}', "n"),
        (b'{"prompt": "a", "n": 17}', "n"),
        (b'{"prompt": "a", "logprobs": 21}', "logprobs"),
        (b'{"prompt": "a", "logprobs": -1}', "logprobs"),
        (b'{"prompt": "a", "suffix": "z"}', "suffix"),
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
            "tools[0].function",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}',
            "tool_choice",
        ),
        (
            b'{"messages": [{"role": "assistant", "content": "a", "tool_calls": [{}]}]}',
            "messages[0].tool_calls[0].function.name",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "frequency_penalty": 3}',
            "frequency_penalty",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}',
            "top_logprobs",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true,'
            b' "top_logprobs": 21}',
            "top_logprobs",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -1}',
            "max_completion_tokens",
        ),
    ],
)
def test_chat_refusals(body: bytes, param: str) -> None:
    assert refusal(body, ChatBody).param == param


def test_neutral_values_pass() -> None:
    body = (
        b'{"messages": [{"role": "user", "content": "a"}], "presence_penalty": 0, "n": 1,'
        b' "logprobs": false, "tool_choice": "none", "response_format": {"type": "text"},'
        b' "logit_bias": {}, "repetition_penalty": 1.0, "user": "u"}'
    )
    assert chat_job(decode(body, ChatBody), MODEL).sampling == SamplingParams()


def test_sampling_pipeline_parameters_reach_the_job() -> None:
    body = (
        b'{"prompt": "a", "presence_penalty": 0.5, "frequency_penalty": -1,'
        b' "repetition_penalty": 1.3, "logit_bias": {"7": -100, "9": 2.5}, "logprobs": 3,'
        b' "echo": true, "min_tokens": 2, "seed": 4}'
    )
    s = completion_job(decode(body, CompletionBody), MODEL).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.3)
    assert s.logit_bias == {7: -100.0, 9: 2.5}
    assert (s.return_logprob, s.top_logprobs, s.logprob_start_len) == (True, 3, 0)
    assert (s.min_new_tokens, s.seed) == (2, 4)
    chat = b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 4}'
    c = chat_job(decode(chat, ChatBody), MODEL).sampling
    assert (c.return_logprob, c.top_logprobs, c.logprob_start_len) == (True, 4, -1)


def test_native_batch_and_n() -> None:
    body = (
        b'{"text": ["a", "b"], "rid": ["r1", "r2"], "return_logprob": true,'
        b' "top_logprobs_num": 2, "logprob_start_len": 0, "sampling_params": {"n": 2, "seed": 1}}'
    )
    jobs, many = native_jobs(decode(body, GenerateBody))
    assert many
    assert [j.rid for j in jobs] == ["r1", "r1-1", "r2", "r2-1"]
    assert [j.prompt for j in jobs] == [TextPrompt(text=t) for t in "aabb"]
    assert [j.sampling.seed for j in jobs] == [1, 2, 1, 2]
    assert all(j.sampling.top_logprobs == 2 and j.sampling.logprob_start_len == 0 for j in jobs)
    ids, many = native_jobs(decode(b'{"input_ids": [[1, 2], [3]]}', GenerateBody))
    assert many and [j.prompt for j in ids] == [
        TokenPrompt(input_ids=[1, 2]),
        TokenPrompt(input_ids=[3]),
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"text": "a", "sampling_params": {"n": 0}}', "sampling_params.n"),
        (b'{"text": "a", "sampling_params": {"n": 17}}', "sampling_params.n"),
        (b'{"text": "a", "top_logprobs_num": 21}', "top_logprobs_num"),
        (b'{"text": "a", "logprob_start_len": -2}', "logprob_start_len"),
        (b'{"text": ["a", "b"], "rid": "r"}', "rid"),
        (b'{"text": ["a", "b"], "rid": ["r", "r"]}', "rid"),
        (b'{"text": "a", "rid": "bad rid"}', "rid"),
        (b'{"text": []}', "text"),
        (b'{"text": ["a", ""]}', "text[1]"),
        (b'{"input_ids": [[1], [true]]}', "input_ids[1]"),
        (b'{"input_ids": [[1], 2]}', "input_ids[1]"),
        (
            b'{"text": "a", "sampling_params": {"repetition_penalty": 0}}',
            "sampling_params.repetition_penalty",
        ),
        (
            b'{"text": "a", "sampling_params": {"presence_penalty": 9}}',
            "sampling_params.presence_penalty",
        ),
        (
            b'{"text": "a", "sampling_params": {"logit_bias": {"1": -101}}}',
            "sampling_params.logit_bias[1]",
        ),
        (b'{"text": "a", "sampling_params": {"top_p": 0}}', "sampling_params.top_p"),
        (b'{"text": "a", "sampling_params": {"min_p": -0.1}}', "sampling_params.min_p"),
        (b'{"text": "a", "sampling_params": {"top_k": 0}}', "sampling_params.top_k"),
        (b'{"text": "a", "sampling_params": {"temperature": -1}}', "sampling_params.temperature"),
        (
            b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}',
            "sampling_params.max_new_tokens",
        ),
    ],
)
def test_native_refusals(body: bytes, param: str) -> None:
    assert refusal(body, GenerateBody).param == param


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


def test_a_tiny_positive_top_p_is_accepted_as_sent() -> None:
    """1e-165 is a valid (0, 1] value: the sampler keeps the most likely token for it."""
    job = completion_jobs(decode(b'{"prompt": "a", "top_p": 1e-165}', CompletionBody), MODEL)[0]
    assert job.sampling.top_p == 1e-165


def test_sglang_frontend_fields_are_accepted() -> None:
    """What SGLang's RuntimeEndpoint sends: a prefill-only request (max_new_tokens 0), stop
    regexes, and unset fields as nulls."""
    body = (
        b'{"text": "a", "sampling_params": {"max_new_tokens": 0, "stop_regex": null,'
        b' "regex": null, "json_schema": null, "n": 1, "stop": [], "stop_token_ids": null},'
        b' "return_logprob": true, "return_text_in_logprobs": true, "logprob_start_len": 0}'
    )
    (job,), _ = native_jobs(decode(body, GenerateBody))
    assert job.sampling.max_new_tokens == 0 and job.sampling.stop_regex == []
    one = b'{"text": "a", "sampling_params": {"stop_regex": "[0-9]+"}}'
    (job,), _ = native_jobs(decode(one, GenerateBody))
    assert job.sampling.stop_regex == ["[0-9]+"]
    many = b'{"text": "a", "sampling_params": {"stop_regex": ["x", "y+z"]}}'
    (job,), _ = native_jobs(decode(many, GenerateBody))
    assert job.sampling.stop_regex == ["x", "y+z"]


@pytest.mark.parametrize(
    ("regexes", "param", "words"),
    [
        (b'"[0-9"', "sampling_params.stop_regex", "not a valid regular expression"),
        (b'["a", "(b"]', "sampling_params.stop_regex[1]", "not a valid regular expression"),
        (b'"a*"', "sampling_params.stop_regex", "matches the empty string"),
        (b'["a"' + b', "a"' * 16 + b"]", "sampling_params.stop_regex", "at most 16"),
    ],
)
def test_bad_stop_regexes_are_refused(regexes: bytes, param: str, words: str) -> None:
    body = b'{"text": "a", "sampling_params": {"stop_regex": %s}}' % regexes
    error = refusal(body, GenerateBody)
    assert error.param == param and words in error.message, error.message


# --- SGLang's fields -------------------------------------------------------------------------

# What SGLang's bench_serving (sglang 0.5.5, --backend sglang) posts to /generate.
BENCH_SERVING_GENERATE = (
    b'{"text": "hi", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,'
    b' "ignore_eos": true}, "stream": true, "lora_path": null, "return_logprob": false,'
    b' "logprob_start_len": -1}'
)


def test_sglang_fields_at_their_off_values_pass() -> None:
    job = native_job(decode(BENCH_SERVING_GENERATE, GenerateBody))
    assert job.sampling.max_new_tokens == 8 and job.sampling.ignore_eos
    off = (
        b'{"text": "hi", "lora_path": [null], "return_hidden_states": [false, false],'
        b' "image_data": null, "log_metrics": false, "no_logs": true, "validation_time": 1.5,'
        b' "conversation_id": "c", "sampling_params": {"stream_interval": 4}}'
    )
    assert native_job(decode(off, GenerateBody)).sampling == SamplingParams(max_new_tokens=128)
    chat = b'{"messages": [{"role": "user", "content": "a"}], "lora_path": null, "priority": null}'
    assert chat_job(decode(chat, ChatBody), MODEL).sampling == SamplingParams()


def _set(field: str) -> Any:
    """A value that asks for what `field` does."""
    if field in ("return_hidden_states", "background", "return_bytes", "return_entropy"):
        return True
    return {"data_parallel_rank": 1, "priority": 1, "bootstrap_port": 8998}.get(field, "x")


OPENAI_REFUSED = sorted(set(REASONS) & set(ChatBody.__struct_fields__))
NATIVE_REFUSED = sorted(set(REASONS) & set(GenerateBody.__struct_fields__))
SAMPLING_REFUSED = sorted(set(REASONS) & set(NativeSamplingBody.__struct_fields__))
STRUCTURED_REFUSED = sorted(set(REASONS) & set(StructuredOutputs.__struct_fields__))


def test_every_refused_field_is_declared_somewhere() -> None:
    declared = set(OPENAI_REFUSED) | set(NATIVE_REFUSED) | set(SAMPLING_REFUSED)
    assert declared | set(STRUCTURED_REFUSED) == set(REASONS)


@pytest.mark.parametrize("field", STRUCTURED_REFUSED)
def test_vllm_structured_outputs_options_it_cannot_honour_are_refused(field: str) -> None:
    value = True if field.startswith("disable_") else "x"
    body = msgspec.json.encode({"prompt": "a", "structured_outputs": {field: value}})
    assert refusal(body, CompletionBody).param == f"structured_outputs.{field}"


@pytest.mark.parametrize(
    ("extra", "constraint"),
    [
        ({"guided_json": {"type": "object"}}, JsonSchemaConstraint(schema='{"type":"object"}')),
        ({"guided_regex": "a+"}, RegexConstraint(pattern="a+")),
        ({"guided_choice": ["x", "y"]}, ChoiceConstraint(choices=["x", "y"])),
        ({"guided_grammar": 'root ::= "a"'}, EbnfConstraint(grammar='root ::= "a"')),
        ({"structured_outputs": {"json": "{}"}}, JsonSchemaConstraint(schema="{}")),
        ({"structured_outputs": {"regex": "a+"}}, RegexConstraint(pattern="a+")),
        ({"structured_outputs": {"choice": ["x"]}}, ChoiceConstraint(choices=["x"])),
        ({"structured_outputs": {"grammar": "g"}}, EbnfConstraint(grammar="g")),
        (
            {"structured_outputs": {"json_object": True, "disable_fallback": True}},
            JsonSchemaConstraint(schema='{"type": "object"}'),
        ),
        ({"guided_decoding_backend": "xgrammar"}, None),
    ],
)
@pytest.mark.parametrize("type_", [ChatBody, CompletionBody])
def test_vllm_structured_output_fields(extra: dict[str, Any], constraint: Any, type_: type) -> None:
    fields: dict[str, Any] = {"prompt": "a"} if type_ is CompletionBody else {}
    if type_ is ChatBody:
        fields["messages"] = [{"role": "user", "content": "a"}]
    body: Any = decode(msgspec.json.encode({**fields, **extra}), type_)
    job = completion_job(body, MODEL) if type_ is CompletionBody else chat_job(body, MODEL)
    if constraint is None:
        assert job.constraint is None
    else:  # the field is named as the client wrote it
        (field,) = extra
        if field == "structured_outputs":
            field += "." + next(iter(extra[field]))  # its first key: the constraint's
        assert job.constraint == msgspec.structs.replace(constraint, param=field)


def test_vllm_include_stop_str_in_output_is_no_stop_trim() -> None:
    body = b'{"prompt": "a", "stop": ["x"], "include_stop_str_in_output": true}'
    assert completion_job(decode(body, CompletionBody), MODEL).sampling.no_stop_trim
    both = b'{"prompt": "a", "guided_regex": "a", "structured_outputs": {"choice": ["b"]}}'
    assert refusal(both, CompletionBody).param == "structured_outputs.choice"


@pytest.mark.parametrize("field", NATIVE_REFUSED)
def test_sglang_fields_radixserve_cannot_honour_are_refused_by_name(field: str) -> None:
    body = msgspec.json.encode({"text": "hi", field: _set(field)})
    e = refusal(body, GenerateBody)
    assert e.param == field and f"{field} is not supported: {REASONS[field]}" == e.message


@pytest.mark.parametrize("field", SAMPLING_REFUSED)
def test_sglang_sampling_fields_radixserve_cannot_honour_are_refused(field: str) -> None:
    body = msgspec.json.encode({"text": "hi", "sampling_params": {field: _set(field)}})
    assert refusal(body, GenerateBody).param == f"sampling_params.{field}"


@pytest.mark.parametrize("field", OPENAI_REFUSED)
@pytest.mark.parametrize("type_", [ChatBody, CompletionBody])
def test_openai_bodies_refuse_them_too(field: str, type_: type) -> None:
    fields: dict[str, Any] = {field: _set(field)}
    if type_ is ChatBody:
        fields["messages"] = [{"role": "user", "content": "a"}]
    else:
        fields["prompt"] = "a"
    assert refusal(msgspec.json.encode(fields), type_).param == field


@pytest.mark.parametrize(
    ("extra", "constraint"),
    [
        ({"regex": "[0-9]+"}, RegexConstraint(pattern="[0-9]+", param="regex")),
        ({"ebnf": 'root ::= "a"'}, EbnfConstraint(grammar='root ::= "a"', param="ebnf")),
        (
            {"json_schema": {"type": "object"}},
            JsonSchemaConstraint(schema='{"type":"object"}', param="json_schema"),
        ),
    ],
)
def test_sglang_constraints_on_the_openai_endpoints(
    extra: dict[str, Any], constraint: object
) -> None:
    body = msgspec.json.encode({"prompt": "a", **extra})
    assert completion_job(decode(body, CompletionBody), MODEL).constraint == constraint
    if "json_schema" not in extra:  # SGLang's chat takes regex and ebnf, not json_schema
        chat = msgspec.json.encode({"messages": [{"role": "user", "content": "a"}], **extra})
        assert chat_job(decode(chat, ChatBody), MODEL).constraint == constraint


@pytest.mark.parametrize(
    ("body", "type_", "param"),
    [
        (b'{"prompt": "a", "regex": "a", "ebnf": "root ::= \\"a\\""}', CompletionBody, "ebnf"),
        (
            b'{"prompt": "a", "response_format": {"type": "json_object"}, "json_schema": "{}"}',
            CompletionBody,
            "json_schema",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "regex": "a",'
            b' "response_format": {"type": "json_object"}}',
            ChatBody,
            "regex",
        ),
        (b'{"prompt": "a", "regex": " "}', CompletionBody, "regex"),
        (b'{"prompt": "a", "stop_regex": "("}', CompletionBody, "stop_regex"),
        (b'{"prompt": ["a", "b"], "rid": "r"}', CompletionBody, "rid"),
        (b'{"prompt": "a", "rid": ["r"]}', CompletionBody, "rid"),
        (b'{"prompt": ["a", "b"], "rid": ["r", "r"]}', CompletionBody, "rid"),
        (b'{"messages": [{"role": "user", "content": "a"}], "rid": "bad rid"}', ChatBody, "rid"),
        (
            b'{"messages": [{"role": "user", "content": "a"}], "continue_final_message": true}',
            ChatBody,
            "continue_final_message",
        ),
        (
            b'{"text": "a", "sampling_params": {"sampling_seed": -1e30}}',
            GenerateBody,
            "sampling_params.sampling_seed",
        ),
    ],
)
def test_sglang_field_refusals(body: bytes, type_: type, param: str) -> None:
    assert refusal(body, type_).param == param


def test_stop_regex_no_stop_trim_and_zero_tokens_on_the_openai_endpoints() -> None:
    body = b'{"prompt": "a", "stop_regex": ["[0-9]"], "no_stop_trim": true, "max_tokens": 0}'
    sampling = completion_job(decode(body, CompletionBody), MODEL).sampling
    assert sampling.stop_regex == ["[0-9]"] and sampling.no_stop_trim
    assert sampling.max_new_tokens == 0  # the prompt only, as SGLang (and lm-eval's echo)
    native = b'{"text": "a", "sampling_params": {"no_stop_trim": true, "sampling_seed": 7}}'
    s = native_job(decode(native, GenerateBody)).sampling
    assert s.no_stop_trim and s.seed == 7
    both = b'{"text": "a", "sampling_params": {"seed": 1, "sampling_seed": 7}}'
    assert native_job(decode(both, GenerateBody)).sampling.seed == 1


def test_client_rids_name_the_samples_and_the_batch() -> None:
    chat = b'{"messages": [{"role": "user", "content": "a"}], "rid": "r1"}'
    job = chat_job(decode(chat, ChatBody), MODEL)
    assert [j.rid for j in samples(job, 3)] == ["r1", "r1-1", "r1-2"]
    batch = b'{"prompt": ["a", "b"], "rid": ["x", "y"]}'
    assert [j.rid for j in completion_jobs(decode(batch, CompletionBody), MODEL)] == ["x", "y"]


def test_continue_final_message_renders_into_the_last_message() -> None:
    body = (
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant",'
        b' "content": "The answer is"}], "continue_final_message": true}'
    )
    prompt = chat_job(decode(body, ChatBody), MODEL).prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.continue_final_message and not prompt.add_generation_prompt
    off = b'{"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": false}'
    prompt = chat_job(decode(off, ChatBody), MODEL).prompt
    assert isinstance(prompt, ChatPrompt) and not prompt.add_generation_prompt


def test_openai_fields_that_change_no_output_pass() -> None:
    """What the openai client sends for store, metadata, service tiers, cache keys and the
    like: nothing is stored and the prefix cache needs no key, so the output is the same."""
    body = (
        b'{"messages": [{"role": "user", "content": "a"}], "store": false, "metadata": {"k": "v"},'
        b' "service_tier": "auto", "prompt_cache_key": "u1", "prompt_cache_retention": "24h",'
        b' "safety_identifier": "h", "prediction": {"type": "content", "content": "x"},'
        b' "modalities": ["text"]}'
    )
    assert chat_job(decode(body, ChatBody), MODEL).sampling == SamplingParams()
    audio = b'{"messages": [{"role": "user", "content": "a"}], "modalities": ["text", "audio"]}'
    assert refusal(audio, ChatBody).param == "modalities"


def test_what_smg_posts_to_generate_passes() -> None:
    """SMG's HTTP mode (smg 1.13) forwards /generate with its own fields, a model it may not
    know included; /generate serves the one model and does not read it."""
    body = (
        b'{"text": "hi", "model": "unknown", "sampling_params": {"max_new_tokens": 4},'
        b' "return_text_in_logprobs": false, "stream": false, "log_metrics": true,'
        b' "background": false, "no_logs": false, "return_bytes": false, "return_entropy": false}'
    )
    assert native_job(decode(body, GenerateBody)).sampling.max_new_tokens == 4
