"""radixserve's frontend language: SGLang's `function` / `gen` / `select` / `fork`, run on a
radixserve server (`RuntimeEndpoint`) or on a `radixserve.Engine` in this process.

    import radixserve.lang as rl

    @rl.function
    def pick(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.select("answer", ["yes", "no"]))

    rl.set_default_backend(rl.RuntimeEndpoint("http://localhost:30000"))
    pick.run(question="Is the sky blue?")["answer"]
"""

from __future__ import annotations

from typing import Any

from radixserve.lang.backends import BackendError, EngineBackend, RuntimeEndpoint
from radixserve.lang.executor import ProgramError
from radixserve.lang.ir import DTYPE_REGEX, Expr, Gen, RoleBegin, RoleEnd, Select, Seq
from radixserve.lang.program import Function, function, get_backend, set_default_backend
from radixserve.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "BackendError",
    "EngineBackend",
    "Function",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_server_info",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]

# select's scoring: the mean logprob of the choice's tokens (SGLang's default method; its other
# two, greedy_token_selection and unconditional_likelihood_normalized, are not offered).
token_length_normalized = "token_length_normalized"


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
) -> Gen | Select:
    """Generate into the state (and into variable `name`). With `choices`, a select; with
    `regex`, `json_schema` or `dtype` (int, float, str, bool), constrained output."""
    params = {k: v for k, v in locals().items() if v is not None}
    for key in ("name", "n", "choices"):
        params.pop(key, None)
    if n not in (None, 1):
        raise ValueError(f"gen n must be 1 (for several samples, fork the state): got {n}")
    if choices is not None:
        return select(name, choices, temperature or 0.0)
    if sum(c is not None for c in (regex, json_schema, dtype)) > 1:
        raise ValueError("gen takes at most one of regex, json_schema and dtype")
    dtype_name = dtype.__name__ if isinstance(dtype, type) else dtype
    if dtype_name is not None and dtype_name not in DTYPE_REGEX:
        raise ValueError(f"gen dtype must be int, float, str or bool, got {dtype!r}")
    return Gen(name, params)


def gen_int(name: str | None = None, **kwargs: Any) -> Gen | Select:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen | Select:
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: Any = token_length_normalized,
) -> Select:
    """Choose one of `choices` by the model's token-length-normalised likelihood."""
    if choices_method != token_length_normalized:
        raise ValueError(
            f"select choices_method {choices_method!r} is not supported: only "
            "token_length_normalized (the default)"
        )
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select choices must be a non-empty list of strings")
    if temperature < 0:
        raise ValueError(f"select temperature must be >= 0, got {temperature}")
    return Select(name, list(choices), temperature)


def _role(role: str, expr: Any) -> Seq:
    return RoleBegin(role) + expr + RoleEnd(role)


def system(expr: Any = "") -> Seq:
    return _role("system", expr)


def user(expr: Any = "") -> Seq:
    return _role("user", expr)


def assistant(expr: Any = "") -> Seq:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def flush_cache(backend: Any = None) -> None:
    """Empties the backend's prefix cache (the default backend's when none is given)."""
    get_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return get_backend(backend).get_server_info()


def image(path: Any) -> Expr:
    """Refused: radixserve serves text-only models, so a program cannot add an image."""
    raise ValueError("image(): radixserve serves text-only models; a program cannot add an image")


def video(path: Any, num_frames: int = 0) -> Expr:
    """Refused, as image()."""
    raise ValueError("video(): radixserve serves text-only models; a program cannot add a video")
