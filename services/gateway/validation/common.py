"""What every dialect's validation shares: the validated `Job`, body decoding, token ids, the
model name, request ids, and the fan-out of `n` samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgspec

from services.gateway.errors import ApiError, from_decode_error, invalid
from services.gateway.validation.limits import RID_PATTERN
from services.gateway.validation.tools import ToolPlan
from shared.messages.common import Constraint, SamplingParams
from shared.messages.tokenize import Prompt

T = TypeVar("T")


@dataclass(frozen=True)
class Job:
    """A validated request, ready to be published to the tokenizer."""

    prompt: Prompt
    sampling: SamplingParams
    stream: bool
    include_usage: bool = False  # stream_options.include_usage
    rid: str | None = None  # chosen by the client (SGLang's `rid`)
    constraint: Constraint | None = None  # structured output
    echo: bool = False  # OpenAI completions: the prompt's text comes back before the output
    # whose field names the services' refusals use: "openai", "native", "responses", "embeddings"
    api: str = "openai"
    tools: ToolPlan | None = None  # chat with tools: how its output is read
    embed: bool = False  # /v1/embeddings: the prompt is pooled, nothing generated
    dimensions: int = 0  # /v1/embeddings: how many values to keep (0: all)


def decode(body: bytes, type_: type[T]) -> T:
    """Decode a JSON body; any failure is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        # msgspec 0.23 reports a stray byte as a DecodeError (earlier versions raised
        # UnicodeDecodeError): the same refusal, with the byte found again on this rare path
        if not isinstance(e, msgspec.ValidationError) and "UTF-8" in str(e):
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise not_utf8(bad) from None
        raise from_decode_error(e) from None
    except UnicodeDecodeError as e:  # JSON is UTF-8: a stray byte is the client's error
        raise not_utf8(e) from None
    except RecursionError:  # msgspec recurses per level: ~1,000 levels exhaust the stack
        raise invalid("the body's JSON nests too deeply") from None


def not_utf8(e: UnicodeDecodeError) -> ApiError:
    return invalid(f"the body is not valid UTF-8: byte {e.start} ({e.reason})")


def convert(value: Any, type_: type[T]) -> T:
    """`decode` for a body already parsed into Python values (a gRPC message's fields): the
    same refusals, naming the field the same way."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as e:
        raise from_decode_error(e) from None


def check_rid(rid: str, param: str) -> None:
    if not RID_PATTERN.match(rid):
        raise invalid(f"{param} must be 1 to 128 characters of letters, digits and ._:-", param)


def client_rids(rid: str | list[str] | None, count: int, batched: bool) -> list[str | None]:
    """SGLang's `rid`: None, a string for one prompt, or a list with one per prompt of a
    batch, each checked and none repeated."""
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


def nonempty(value: Any, param: str) -> Any:
    if not value:
        raise invalid(f"{param} must not be empty", param)
    return value


def token_ids(ids: Sequence[Any], param: str) -> list[int]:
    for i, t in enumerate(ids):
        if not 0 <= t < 2**31:
            raise invalid(f"{param}[{i}] must be a token id (>= 0), got {t}", f"{param}[{i}]")
    return list(ids)


def check_model(model: str | None, served_model: str) -> None:
    """A 404 for a model this server does not serve, as OpenAI and vLLM answer it (the
    `openai` client raises NotFoundError); no model named is the served one."""
    if model is not None and model != served_model:
        raise ApiError(
            404,
            f"model {model!r} does not exist: this server serves {served_model!r}",
            "model",
        )


def unsupported(given: bool, param: str) -> None:
    if given:
        raise invalid(f"{param} is not supported yet", param)


def samples(job: Job, n: int | None) -> list[Job]:
    """The jobs of one prompt's `n` samples, with seeds seed, seed+1, ... so a seeded request
    stays reproducible, and a client-chosen rid named rid, rid-1, rid-2, ... as SGLang names
    them. The executor computes the shared prompt once: samples arriving together wait for
    the first and reuse its KV."""
    count = 1 if n is None else n
    seed = job.sampling.seed
    return [
        replace(
            job,
            sampling=msgspec.structs.replace(
                job.sampling, seed=None if seed is None else (seed + i) % 2**63
            ),
            rid=job.rid if i == 0 or job.rid is None else f"{job.rid}-{i}",
        )
        for i in range(count)
    ]
