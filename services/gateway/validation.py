"""Request bodies -> validated `Job`s (prompt + SamplingParams). Pure: no I/O, no awaits.

The gateway checks types and ranges; the tokenizer checks lengths against the context. Every
refusal is a 400 whose `param` names the field as the client spelled it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgspec

from services.gateway.errors import from_decode_error, invalid
from services.gateway.protocol import (
    ChatBody,
    ChatMessageBody,
    CompletionBody,
    GenerateBody,
    JsonObjectFormat,
    JsonSchemaFormat,
    NativeSamplingBody,
    ResponseFormat,
)
from shared.messages.common import (
    ChoiceConstraint,
    Constraint,
    EbnfConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
)
from shared.messages.tokenize import ChatMessage, ChatPrompt, Prompt, TextPrompt, TokenPrompt

T = TypeVar("T")

MAX_TOKENS_LIMIT = 1_000_000  # a sanity bound; the tokenizer checks the real context length
MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
RID_PATTERN = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
SCHEMA_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")  # OpenAI's rule for json_schema.name
MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema, regex or grammar; the grammar service checks it
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Job:
    """A validated request, ready to be published to the tokenizer."""

    prompt: Prompt
    sampling: SamplingParams
    stream: bool
    include_usage: bool = False  # stream_options.include_usage
    rid: str | None = None  # chosen by the client (/generate only)
    constraint: Constraint | None = None  # structured output


def decode(body: bytes, type_: type[T]) -> T:
    """Decode a JSON body; any failure is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        raise from_decode_error(e) from None


def completion_job(body: CompletionBody, served_model: str) -> Job:
    check_model(body.model, served_model)
    _check_openai_common(body)
    unsupported(body.echo, "echo")
    unsupported(body.logprobs is not None, "logprobs")
    unsupported(bool(body.suffix), "suffix")
    if body.best_of is not None and body.best_of != 1:
        raise invalid("best_of must be 1 (best_of > 1 is not supported yet)", "best_of")
    return Job(
        prompt=completion_prompt(body.prompt),
        sampling=_openai_sampling(body, body.max_tokens, "max_tokens"),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        constraint=response_format_constraint(body.response_format),
    )


def chat_job(body: ChatBody, served_model: str) -> Job:
    check_model(body.model, served_model)
    _check_openai_common(body)
    unsupported(body.logprobs, "logprobs")
    unsupported(bool(body.top_logprobs), "top_logprobs")
    unsupported(bool(body.tools), "tools")
    unsupported(body.tool_choice not in (None, "none", "auto"), "tool_choice")
    max_tokens, max_name = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
        max_tokens, max_name = body.max_completion_tokens, "max_completion_tokens"
    return Job(
        prompt=chat_prompt(body.messages),
        sampling=_openai_sampling(body, max_tokens, max_name),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        constraint=response_format_constraint(body.response_format),
    )


def native_job(body: GenerateBody) -> Job:
    s = body.sampling_params
    unsupported(body.return_logprob, "return_logprob")
    if s.n != 1:
        raise _bad_n(s.n, "sampling_params.n")
    unsupported(s.presence_penalty != 0.0, "sampling_params.presence_penalty")
    unsupported(s.frequency_penalty != 0.0, "sampling_params.frequency_penalty")
    unsupported(s.repetition_penalty != 1.0, "sampling_params.repetition_penalty")
    if body.rid is not None and not RID_PATTERN.match(body.rid):
        raise invalid("rid must be 1 to 128 characters of letters, digits and ._:-", "rid")
    return Job(
        prompt=native_prompt(body),
        sampling=_native_sampling(s),
        stream=body.stream,
        rid=body.rid,
        constraint=native_constraint(s),
    )


# --- prompts ---


def completion_prompt(prompt: str | list[str | int | list[int]]) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return TextPrompt(text=prompt)
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in prompt):
        return TokenPrompt(input_ids=token_ids(prompt, "prompt"))
    if len(prompt) > 1:
        raise invalid(
            "prompt must be a string or a list of token ids; batches of prompts are not "
            "supported yet (send one request per prompt)",
            "prompt",
        )
    only = prompt[0]
    if isinstance(only, str):
        return completion_prompt(only)
    assert isinstance(only, list)  # the decoder admits only str | int | list[int]
    if not only:
        raise invalid("prompt must not be empty", "prompt")
    return TokenPrompt(input_ids=token_ids(only, "prompt[0]"))


def chat_prompt(messages: list[ChatMessageBody]) -> ChatPrompt:
    if not messages:
        raise invalid("messages must not be empty", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if m.role not in CHAT_ROLES:
            raise invalid(
                f"{at}.role must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}", f"{at}.role"
            )
        unsupported(bool(m.tool_calls), f"{at}.tool_calls")
        if m.content is None and m.role != "assistant":
            raise invalid(f"{at}.content is required for role {m.role!r}", f"{at}.content")
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for it
        out.append(ChatMessage(role=role, content=message_text(m.content, f"{at}.content")))
    return ChatPrompt(messages=out)


def message_text(content: str | list[dict[str, Any]] | None, at: str) -> str:
    """A message's text: the string itself, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise invalid(
                f"{at}[{j}].type must be 'text' (got {kind!r}): only text content is supported",
                f"{at}[{j}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{at}[{j}].text must be a string", f"{at}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def native_prompt(body: GenerateBody) -> Prompt:
    if body.text is not None and body.input_ids is not None:
        raise invalid("give either text or input_ids, not both", "input_ids")
    if body.input_ids is not None:
        if not body.input_ids:
            raise invalid("input_ids must not be empty", "input_ids")
        return TokenPrompt(input_ids=token_ids(body.input_ids, "input_ids"))
    if not body.text:
        raise invalid("text (or input_ids) is required and must not be empty", "text")
    return TextPrompt(text=body.text)


def token_ids(ids: Sequence[Any], param: str) -> list[int]:
    for i, t in enumerate(ids):
        if not 0 <= t < 2**31:
            raise invalid(f"{param}[{i}] must be a token id (>= 0), got {t}", f"{param}[{i}]")
    return list(ids)


# --- structured output: shapes only (the grammar service compiles and checks validity) ---


def response_format_constraint(fmt: ResponseFormat | None) -> Constraint | None:
    """OpenAI `response_format`: text (no constraint), json_object, or json_schema."""
    if isinstance(fmt, JsonObjectFormat):
        return JsonSchemaConstraint(schema='{"type": "object"}', param="response_format")
    if not isinstance(fmt, JsonSchemaFormat):
        return None
    spec, at = fmt.json_schema, "response_format.json_schema"
    if not SCHEMA_NAME_PATTERN.match(spec.name):
        raise invalid(
            f"{at}.name must be 1 to 64 letters, digits, underscores or dashes", f"{at}.name"
        )
    if spec.schema is None:
        raise invalid(f"{at}.schema is required", f"{at}.schema")
    return JsonSchemaConstraint(
        schema=_schema_text(spec.schema, f"{at}.schema"), param=f"{at}.schema"
    )


def native_constraint(s: NativeSamplingBody) -> Constraint | None:
    """`sampling_params.json_schema` / `regex` / `ebnf` / `choices`: at most one of them."""
    given = [
        name for name in ("json_schema", "regex", "ebnf", "choices") if getattr(s, name) is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(f"sampling_params.{n}" for n in given)
        raise invalid(
            f"give at most one structured-output constraint; got {names}",
            f"sampling_params.{given[1]}",
        )
    param = f"sampling_params.{given[0]}"
    if s.json_schema is not None:
        return JsonSchemaConstraint(schema=_schema_text(s.json_schema, param), param=param)
    if s.regex is not None:
        return RegexConstraint(pattern=_constraint_text(s.regex, param), param=param)
    if s.ebnf is not None:
        return EbnfConstraint(grammar=_constraint_text(s.ebnf, param), param=param)
    assert s.choices is not None
    if not s.choices or len(s.choices) > MAX_CHOICES:
        raise invalid(f"{param} must hold 1 to {MAX_CHOICES} strings", param)
    if sum(len(c) for c in s.choices) > MAX_CONSTRAINT_CHARS:
        raise invalid(f"{param} may hold at most {MAX_CONSTRAINT_CHARS} characters", param)
    return ChoiceConstraint(choices=list(s.choices), param=param)


def _schema_text(schema: str | dict[str, Any], param: str) -> str:
    """A schema object as JSON text (key order kept: it is the order properties are generated
    in); a string is passed on as it is."""
    text = schema if isinstance(schema, str) else msgspec.json.encode(schema).decode()
    return _constraint_text(text, param)


def _constraint_text(text: str, param: str) -> str:
    if not text.strip():
        raise invalid(f"{param} must not be empty", param)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise invalid(f"{param} may be at most {MAX_CONSTRAINT_CHARS} characters long", param)
    return text


# --- sampling ---


def check_model(model: str | None, served_model: str) -> None:
    if model is not None and model != served_model:
        raise invalid(
            f"model {model!r} is not served here; this server serves {served_model!r}", "model"
        )


def unsupported(given: bool, param: str) -> None:
    if given:
        raise invalid(f"{param} is not supported yet", param)


MAX_N = 16  # parallel samples of one OpenAI request


def _bad_n(n: int, param: str) -> Exception:
    if n < 1:
        return invalid(f"{param} must be at least 1, got {n}", param)
    return invalid("n > 1 is not supported yet", param)


def samples(job: Job, n: int | None) -> list[Job]:
    """The jobs of one OpenAI request: `n` samples of the same prompt, with seeds seed,
    seed+1, ... so a seeded request stays reproducible. The executor computes the shared
    prompt once: samples arriving together wait for the first and reuse its KV."""
    count = 1 if n is None else n
    seed = job.sampling.seed
    return [
        replace(
            job,
            sampling=msgspec.structs.replace(
                job.sampling, seed=None if seed is None else (seed + i) % 2**63
            ),
        )
        for i in range(count)
    ]


def _check_openai_common(body: CompletionBody | ChatBody) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}, got {body.n}", "n")
    unsupported(bool(body.presence_penalty), "presence_penalty")
    unsupported(bool(body.frequency_penalty), "frequency_penalty")
    unsupported(bool(body.logit_bias), "logit_bias")
    unsupported(body.repetition_penalty not in (None, 1.0), "repetition_penalty")


def _openai_sampling(
    body: CompletionBody | ChatBody, max_tokens: int | None, max_name: str
) -> SamplingParams:
    names = {"max_new_tokens": max_name, "min_new_tokens": "min_tokens"}
    return sampling_params(
        lambda field: names.get(field, field),
        max_new_tokens=max_tokens,
        min_new_tokens=body.min_tokens or 0,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        seed=body.seed,
    )


def _native_sampling(s: NativeSamplingBody) -> SamplingParams:
    return sampling_params(
        lambda field: f"sampling_params.{field}",
        max_new_tokens=s.max_new_tokens,
        min_new_tokens=s.min_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids or [],
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
        seed=s.seed,
    )


def sampling_params(
    name: Callable[[str], str],
    *,
    max_new_tokens: int | None,
    min_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    stop: str | list[str] | None,
    stop_token_ids: list[int],
    ignore_eos: bool,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
    seed: int | None,
) -> SamplingParams:
    """Range-check sampling controls; `name(field)` is the field as the client spelled it."""
    if max_new_tokens is not None and not 1 <= max_new_tokens <= MAX_TOKENS_LIMIT:
        raise invalid(
            f"{name('max_new_tokens')} must be between 1 and {MAX_TOKENS_LIMIT}, "
            f"got {max_new_tokens}",
            name("max_new_tokens"),
        )
    if min_new_tokens < 0 or (max_new_tokens is not None and min_new_tokens > max_new_tokens):
        raise invalid(
            f"{name('min_new_tokens')} must be between 0 and {name('max_new_tokens')}, "
            f"got {min_new_tokens}",
            name("min_new_tokens"),
        )
    _check_range(name("temperature"), temperature, temperature >= 0, ">= 0 (0 is greedy)")
    _check_range(name("top_p"), top_p, 0 < top_p <= 1, "in (0, 1]")
    _check_range(name("top_k"), top_k, top_k == -1 or top_k >= 1, "-1 (off) or >= 1")
    _check_range(name("min_p"), min_p, 0 <= min_p <= 1, "in [0, 1]")
    if seed is not None and not -(2**63) <= seed < 2**64:  # must fit the wire's 64 bits
        raise invalid(f"{name('seed')} must fit in 64 bits, got {seed}", name("seed"))
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=stop_strings(stop, name("stop")),
        stop_token_ids=token_ids(stop_token_ids, name("stop_token_ids")),
        ignore_eos=ignore_eos,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        seed=seed,
    )


def _check_range(param: str, value: float, ok: bool, allowed: str) -> None:
    if not ok or not math.isfinite(value):
        raise invalid(f"{param} must be {allowed}, got {value}", param)


def stop_strings(stop: str | list[str] | None, param: str) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"{param} may hold at most {MAX_STOP_STRINGS} strings", param)
    if any(not s for s in stops):
        raise invalid(f"{param} strings must not be empty", param)
    return stops
