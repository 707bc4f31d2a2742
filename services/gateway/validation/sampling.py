"""The sampling controls every dialect shares: ranges, stop strings and logit biases, each
refusal naming the field as the client spelled it; and the OpenAI and native field sets."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from services.gateway.errors import invalid
from services.gateway.protocol import ChatBody, CompletionBody, NativeSamplingBody
from services.gateway.validation.common import token_ids
from services.gateway.validation.limits import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_REGEX_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
)
from shared.messages.common import SamplingParams


def check_openai_common(body: CompletionBody | ChatBody) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}, got {body.n}", "n")


def openai_sampling(
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
        stop_regex=body.stop_regex,
        no_stop_trim=body.no_stop_trim or body.include_stop_str_in_output,
    )


def native_sampling(s: NativeSamplingBody) -> SamplingParams:
    # a refusal of the seed names the field the client gave it in
    seed_field = "sampling_seed" if s.seed is None and s.sampling_seed is not None else "seed"
    return sampling_params(
        lambda field: f"sampling_params.{seed_field if field == 'seed' else field}",
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
        seed=s.seed if s.seed is not None else s.sampling_seed,
        repetition_penalty=s.repetition_penalty,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        logit_bias=s.logit_bias,
        stop_regex=s.stop_regex,
        no_stop_trim=s.no_stop_trim,
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
    stop_regex: str | list[str] | None = None,
    no_stop_trim: bool = False,
) -> SamplingParams:
    """Range-check sampling controls; `name(field)` is the field as the client spelled it.
    max_new_tokens 0 is SGLang's "the prompt only": computed and cached, for its logprobs (with
    echo, what lm-evaluation-harness asks OpenAI-style servers for), nothing generated."""
    if max_new_tokens is not None and not 0 <= max_new_tokens <= MAX_TOKENS_LIMIT:
        raise invalid(
            f"{name('max_new_tokens')} must be between 0 and {MAX_TOKENS_LIMIT}, "
            f"got {max_new_tokens}",
            name("max_new_tokens"),
        )
    if min_new_tokens < 0 or (max_new_tokens is not None and min_new_tokens > max_new_tokens):
        raise invalid(
            f"{name('min_new_tokens')} must be between 0 and {name('max_new_tokens')}, "
            f"got {min_new_tokens}",
            name("min_new_tokens"),
        )
    check_range(name("temperature"), temperature, temperature >= 0, ">= 0 (0 is greedy)")
    check_range(name("top_p"), top_p, 0 < top_p <= 1, "in (0, 1]")
    check_range(name("top_k"), top_k, top_k == -1 or top_k >= 1, "-1 (off) or >= 1")
    check_range(name("min_p"), min_p, 0 <= min_p <= 1, "in [0, 1]")
    for field, value in (
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
    ):
        check_range(name(field), value, -2 <= value <= 2, "between -2 and 2")
    check_range(
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
        stop_regex=stop_regexes(stop_regex, name("stop_regex")),
        no_stop_trim=no_stop_trim,
    )


def logit_biases(bias: dict[str, float] | None, param: str) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids as strings -> a bias in [-100, 100]."""
    out: dict[int, float] = {}
    if len(bias or {}) > MAX_LOGIT_BIAS:
        raise invalid(f"{param} may hold at most {MAX_LOGIT_BIAS} entries", param)
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= 2**31:
            raise invalid(f"{param} keys must be token ids, got {key!r}", param)
        check_range(f"{param}[{key}]", value, -100 <= value <= 100, "between -100 and 100")
        out[int(key)] = float(value)
    return out


def check_range(param: str, value: float, ok: bool, allowed: str) -> None:
    if not ok or not math.isfinite(value):
        raise invalid(f"{param} must be {allowed}, got {value}", param)


def stop_strings(stop: str | list[str] | None, param: str) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"{param} may hold at most {MAX_STOP_STRINGS} strings", param)
    if any(not s for s in stops):
        raise invalid(f"{param} strings must not be empty", param)
    return stops


def stop_regexes(stop: str | list[str] | None, param: str) -> list[str]:
    """SGLang's `stop_regex`: Python regexes, each compiled here so a bad one is a 400."""
    patterns = [stop] if isinstance(stop, str) else list(stop or [])
    if len(patterns) > MAX_STOP_STRINGS:
        raise invalid(f"{param} may hold at most {MAX_STOP_STRINGS} patterns", param)
    for i, p in enumerate(patterns):
        at = f"{param}[{i}]" if isinstance(stop, list) else param
        if len(p) > MAX_STOP_REGEX_CHARS:
            raise invalid(f"{at} may be at most {MAX_STOP_REGEX_CHARS} characters long", at)
        try:
            rx = re.compile(p)
        except re.error as e:
            raise invalid(f"{at} is not a valid regular expression: {e}", at) from None
        if rx.fullmatch(""):
            raise invalid(f"{at} matches the empty string, so it would stop at once", at)
    return patterns
