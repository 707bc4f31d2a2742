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
    echo: bool = False  # OpenAI completions: the prompt's text comes back before the output


def decode(body: bytes, type_: type[T]) -> T:
    """Decode a JSON body; any failure is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        raise from_decode_error(e) from None
    except UnicodeDecodeError as e:  # JSON is UTF-8: a stray byte is the client's error
        raise invalid(f"the body is not valid UTF-8: byte {e.start} ({e.reason})") from None
    except RecursionError:  # msgspec recurses per level: ~1,000 levels exhaust the stack
        raise invalid("the body's JSON nests too deeply") from None


def completion_jobs(body: CompletionBody, served_model: str) -> list[Job]:
    """One job per prompt (a list of prompts is a batch); `n` / `best_of` fan out later."""
    check_model(body.model, served_model)
    _check_openai_common(body)
    if body.suffix:
        raise invalid(
            "suffix is not supported: this server has no fill-in-the-middle mode", "suffix"
        )
    _check_range(
        "logprobs",
        body.logprobs or 0,
        0 <= (body.logprobs or 0) <= MAX_LOGPROBS,
        f"between 0 and {MAX_LOGPROBS}",
    )
    best_of_count(body)
    sampling = _openai_sampling(body, body.max_tokens, "max_tokens")
    if body.logprobs is not None:
        sampling = msgspec.structs.replace(
            sampling,
            return_logprob=True,
            top_logprobs=body.logprobs,
            # echo with logprobs covers the prompt too, as OpenAI's API does
            logprob_start_len=0 if body.echo else -1,
        )
    return [
        Job(
            prompt=p,
            sampling=sampling,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            constraint=response_format_constraint(body.response_format),
            echo=body.echo,
        )
        for p in completion_prompts(body.prompt)
    ]


def best_of_count(body: CompletionBody) -> int:
    """How many samples to generate per prompt: `best_of`, of which the `n` with the highest
    cumulative logprob are returned (OpenAI's rule: best_of >= n, and no streaming)."""
    n = body.n or 1
    if body.best_of is None:
        return n
    if not n <= body.best_of <= MAX_N:
        raise invalid(f"best_of must be between n ({n}) and {MAX_N}, got {body.best_of}", "best_of")
    if body.stream and body.best_of > n:
        raise invalid("best_of > n cannot be streamed: set stream to false", "best_of")
    return body.best_of


def chat_job(body: ChatBody, served_model: str) -> Job:
    check_model(body.model, served_model)
    _check_openai_common(body)
    unsupported(bool(body.tools), "tools")
    unsupported(body.tool_choice not in (None, "none", "auto"), "tool_choice")
    if body.top_logprobs is not None:
        _check_range(
            "top_logprobs",
            body.top_logprobs,
            0 <= body.top_logprobs <= MAX_LOGPROBS,
            f"between 0 and {MAX_LOGPROBS}",
        )
        if not body.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens, max_name = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
        max_tokens, max_name = body.max_completion_tokens, "max_completion_tokens"
    sampling = _openai_sampling(body, max_tokens, max_name)
    if body.logprobs:
        sampling = msgspec.structs.replace(
            sampling, return_logprob=True, top_logprobs=body.top_logprobs or 0
        )
    return Job(
        prompt=chat_prompt(body.messages),
        sampling=sampling,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        constraint=response_format_constraint(body.response_format),
    )


def native_jobs(body: GenerateBody) -> tuple[list[Job], bool]:
    """The jobs of a /generate body, and whether it was a batch (a list of prompts): one job
    per prompt, each `sampling_params.n` times, prompt-major, as SGLang orders them."""
    s = body.sampling_params
    if not 1 <= s.n <= MAX_N:
        raise invalid(
            f"sampling_params.n must be between 1 and {MAX_N}, got {s.n}", "sampling_params.n"
        )
    _check_range(
        "top_logprobs_num",
        body.top_logprobs_num,
        0 <= body.top_logprobs_num <= MAX_LOGPROBS,
        f"between 0 and {MAX_LOGPROBS}",
    )
    _check_range(
        "logprob_start_len",
        body.logprob_start_len,
        body.logprob_start_len >= -1,
        "-1 (no prompt logprobs) or a prompt position >= 0",
    )
    prompts, batched = native_prompts(body)
    rids = native_rids(body.rid, len(prompts), batched)
    sampling = _native_sampling(s)
    if body.return_logprob:
        sampling = msgspec.structs.replace(
            sampling,
            return_logprob=True,
            top_logprobs=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len,
        )
    constraint = native_constraint(s)
    jobs = []
    for prompt, rid in zip(prompts, rids, strict=True):
        job = Job(
            prompt=prompt, sampling=sampling, stream=body.stream, rid=rid, constraint=constraint
        )
        for i, sample in enumerate(samples(job, s.n)):
            # SGLang names the samples of a client-chosen rid rid, rid-1, rid-2, ...
            jobs.append(sample if i == 0 or rid is None else replace(sample, rid=f"{rid}-{i}"))
    return jobs, batched or s.n > 1


def check_rid(rid: str, param: str) -> None:
    if not RID_PATTERN.match(rid):
        raise invalid(f"{param} must be 1 to 128 characters of letters, digits and ._:-", param)


def native_rids(rid: str | list[str] | None, count: int, batched: bool) -> list[str | None]:
    if rid is None:
        return [None] * count
    rids = rid if isinstance(rid, list) else [rid]
    if isinstance(rid, list) != batched or len(rids) != count:
        raise invalid("rid must be a string for one prompt, or a list with one per prompt", "rid")
    for i, r in enumerate(rids):
        check_rid(r, f"rid[{i}]" if batched else "rid")
    if len(set(rids)) != len(rids):
        raise invalid("rid must not repeat within a batch", "rid")
    return list(rids)


# --- prompts ---


MAX_BATCH = 64  # prompts in one request


def completion_prompts(prompt: str | list[str | int | list[int]]) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [TextPrompt(text=_nonempty(prompt, "prompt"))]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in prompt):
        return [TokenPrompt(input_ids=token_ids(prompt, "prompt"))]
    if len(prompt) > MAX_BATCH:
        raise invalid(f"prompt may hold at most {MAX_BATCH} prompts", "prompt")
    out: list[Prompt] = []
    for i, p in enumerate(prompt):
        at = f"prompt[{i}]"
        if isinstance(p, str):
            out.append(TextPrompt(text=_nonempty(p, at)))
        elif isinstance(p, list):
            out.append(TokenPrompt(input_ids=token_ids(_nonempty(p, at), at)))
        else:
            raise invalid(
                f"{at} must be a string or a list of token ids (the list mixes "
                "token ids with prompts)",
                at,
            )
    return out


def _nonempty(value: Any, param: str) -> Any:
    if not value:
        raise invalid(f"{param} must not be empty", param)
    return value


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


def native_prompts(body: GenerateBody) -> tuple[list[Prompt], bool]:
    """The prompts of /generate, and whether they came as a batch (a list)."""
    if body.text is not None and body.input_ids is not None:
        raise invalid("give either text or input_ids, not both", "input_ids")
    if body.input_ids is not None:
        ids = _nonempty(body.input_ids, "input_ids")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return [TokenPrompt(input_ids=token_ids(ids, "input_ids"))], False
        if len(ids) > MAX_BATCH:
            raise invalid(f"input_ids may hold at most {MAX_BATCH} prompts", "input_ids")
        out: list[Prompt] = []
        for i, p in enumerate(ids):
            at = f"input_ids[{i}]"
            if not isinstance(p, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in p
            ):
                raise invalid(f"{at} must be a list of token ids", at)
            out.append(TokenPrompt(input_ids=token_ids(_nonempty(p, at), at)))
        return out, True
    if isinstance(body.text, list):
        if len(_nonempty(body.text, "text")) > MAX_BATCH:
            raise invalid(f"text may hold at most {MAX_BATCH} prompts", "text")
        return [TextPrompt(text=_nonempty(t, f"text[{i}]")) for i, t in enumerate(body.text)], True
    if not body.text:
        raise invalid("text (or input_ids) is required and must not be empty", "text")
    return [TextPrompt(text=body.text)], False


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
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's and vLLM's bound)


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
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        logit_bias=body.logit_bias,
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
        repetition_penalty=s.repetition_penalty,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        logit_bias=s.logit_bias,
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
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: dict[str, float] | None = None,
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
    for field, value in (
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
    ):
        _check_range(name(field), value, -2 <= value <= 2, "between -2 and 2")
    _check_range(
        name("repetition_penalty"),
        repetition_penalty,
        0 < repetition_penalty <= 2,
        "in (0, 2] (1 is off)",
    )
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
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        logit_bias=logit_biases(logit_bias, name("logit_bias")),
    )


MAX_LOGIT_BIAS = 1024  # entries


def logit_biases(bias: dict[str, float] | None, param: str) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids as strings -> a bias in [-100, 100]."""
    out: dict[int, float] = {}
    if len(bias or {}) > MAX_LOGIT_BIAS:
        raise invalid(f"{param} may hold at most {MAX_LOGIT_BIAS} entries", param)
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= 2**31:
            raise invalid(f"{param} keys must be token ids, got {key!r}", param)
        _check_range(f"{param}[{key}]", value, -100 <= value <= 100, "between -100 and 100")
        out[int(key)] = float(value)
    return out


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
