"""`@function`: a Python function that builds a prompt and generates into it, run on a backend.

@function
def qa(s, question):
    s += user(question)
    s += assistant(gen("answer", max_tokens=64))

state = qa.run(question="What is 2 + 2?")   # or qa.run_batch([{...}, ...])
state["answer"]
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.lang.backends import Backend, as_backend
from radixserve.lang.executor import Executor
from radixserve.lang.state import ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when `run` names none: a RuntimeEndpoint or an Engine
    (None: no default)."""
    global _default_backend
    _default_backend = None if backend is None else as_backend(backend)


def get_backend(backend: Any = None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise RuntimeError(
            "no backend: call radixserve.lang.set_default_backend(RuntimeEndpoint(url)) "
            "or pass backend= to run()"
        )
    return _default_backend


def _defaults(
    max_new_tokens: int = 128,
    n: int = 1,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    ignore_eos: bool = False,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> dict[str, Any]:
    """The sampling every gen of a run starts from (SGLang's defaults); a gen's own win."""
    if n != 1:
        raise ValueError(f"n must be 1 (for several samples, fork the state): got {n}")
    values = dict(locals())
    values.pop("n")
    return {k: v for k, v in values.items() if v is not None and v != []}


_SAMPLING_NAMES = frozenset(inspect.signature(_defaults).parameters)


class Function:
    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.signature = inspect.signature(func)
        if not self.signature.parameters:
            raise TypeError(f"{func.__name__} must take the program's state as its first argument")
        self.bound: dict[str, Any] = {}
        self.__doc__, self.__name__ = func.__doc__, func.__name__

    def bind(self, **kwargs: Any) -> Function:
        """A copy with some arguments fixed."""
        other = Function(self.func)
        other.bound = {**self.bound, **kwargs}
        return other

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:  # checked here, so that a wrong argument fails the call, not a thread
            bound = self.signature.bind(None, *args, **{**self.bound, **kwargs})
        except TypeError as e:
            raise TypeError(f"{self.__name__}: {e}") from None
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(self.signature.parameters)))
        return arguments

    def run(
        self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any
    ) -> ProgramState:
        """Runs the program; returns its state. With stream=True it returns at once and the
        program runs on; read it with `state.text_iter()`."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _SAMPLING_NAMES}
        executor = Executor(get_backend(backend), _defaults(**sampling), stream)
        state = ProgramState(executor)
        arguments = self._arguments(args, kwargs)
        if stream:
            threading.Thread(
                target=self._streamed, args=(state, arguments), name="radixserve-program"
            ).start()
        else:
            try:  # the program's own exception reaches the caller, as from any function
                state.ret_value = self.func(state, **arguments)
            finally:
                executor.end()
            executor.wait()
        return state

    def _streamed(self, state: ProgramState, arguments: dict[str, Any]) -> None:
        try:
            state.ret_value = self.func(state, **arguments)
        except Exception as e:
            # No caller to raise to: recorded, and raised where the state is read.
            state.executor.wait()
            if state.executor.error is None:
                state.executor.error = e
        finally:
            state.executor.end()

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[Any],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Runs the program once per argument set, concurrently; returns the states in order
        (or yields them in order, with generator_style=True)."""
        unknown = set(sampling) - _SAMPLING_NAMES
        if unknown:
            raise TypeError(f"run_batch: unknown argument(s) {sorted(unknown)}")
        _defaults(**sampling)  # a bad value fails here, once
        target = get_backend(backend)
        names = [p for p in self.signature.parameters][1:]
        jobs = [
            b if isinstance(b, dict) else dict(zip(names, _seq(b), strict=False))
            for b in batch_kwargs
        ]
        if not jobs:
            return iter([]) if generator_style else []
        threads = _threads(num_threads, len(jobs))
        states = self._states(jobs, target, sampling, threads, progress_bar)
        return states if generator_style else list(states)

    def _states(
        self,
        jobs: list[dict[str, Any]],
        backend: Backend,
        sampling: dict[str, Any],
        threads: int,
        progress_bar: bool,
    ) -> Iterator[ProgramState]:
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs))
        with ThreadPoolExecutor(threads, thread_name_prefix="radixserve-batch") as pool:
            futures = [pool.submit(self.run, backend=backend, **sampling, **job) for job in jobs]
            if bar is not None:
                for f in futures:
                    f.add_done_callback(lambda _: bar.update(1))
            try:
                for f in futures:
                    yield f.result()
            finally:
                if bar is not None:
                    bar.close()

    def __repr__(self) -> str:
        return f"radixserve.lang.function({self.__name__})"


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: `@function` or `@function()` makes a program of `func(s, ...)`.
    num_api_spec_tokens is accepted for SGLang's signature; it tunes API-model backends
    (OpenAI, Anthropic), which radixserve programs do not run on."""
    if func is None:
        return lambda f: Function(f)
    return Function(func)


def _threads(num_threads: int | str, jobs: int) -> int:
    # Each program mostly waits on the server; many threads keep its batch full.
    if num_threads == "auto":
        return min(jobs, max(64, (os.cpu_count() or 1) * 16))
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int or 'auto', got {num_threads!r}")
    return min(jobs, num_threads)


def _seq(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
