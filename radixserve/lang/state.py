"""A running program's state, as its function sees it (`s`) and as its caller gets it back.

Everything that reads (`s["x"]`, `s.text()`, `s.messages()`) waits for the generations queued
before it; everything that writes (`s += ...`) returns at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from radixserve.lang.executor import END, Executor
from radixserve.lang.ir import RoleBegin, RoleEnd, as_exprs


class ProgramState:
    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.ret_value: Any = None  # what the program's function returned

    # -- writing -----------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("cannot add None to a program's state")
        for expr in as_exprs(other):
            self.executor.submit(expr)
        return self

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.sync()
        self.executor.variables[name] = value

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    # -- reading -----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        self.executor.sync()
        try:
            return self.executor.variables[name]
        except KeyError:
            known = ", ".join(sorted(self.executor.variables)) or "none"
            raise KeyError(f"no variable {name!r} in this program (it has: {known})") from None

    def get_var(self, name: str) -> Any:
        return self[name]

    def __contains__(self, name: str) -> bool:
        self.executor.sync()
        return name in self.executor.variables

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        """The server's meta_info for variable `name`: token counts, cached tokens, logprobs."""
        self.executor.sync()
        return self.executor.meta_info.get(name)

    def text(self) -> str:
        self.executor.sync()
        return self.executor.text

    def messages(self) -> list[dict[str, str]]:
        """The conversation the roles built: [{"role": ..., "content": ...}, ...]."""
        self.executor.sync()
        return [dict(m) for m in self.executor.messages]

    def sync(self) -> None:
        self.executor.sync()

    def error(self) -> BaseException | None:
        """The failure that stopped the program, or None."""
        self.executor.wait()
        return self.executor.error

    # -- roles -------------------------------------------------------------------------------
    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self += RoleBegin(role) + expr + RoleEnd(role)
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.executor.submit(RoleBegin(role))
        yield
        self.executor.submit(RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        """`s.system("...")` adds a system message; `with s.system(): ...` builds one."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    # -- branches ----------------------------------------------------------------------------
    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` copies of this state that run at the same time. The shared text is put in
        the server's prefix cache first, so the branches reuse it instead of each computing it.
        """
        if size < 1:
            raise ValueError(f"fork size must be at least 1, got {size}")
        self.executor.sync()
        ex = self.executor
        if size > 1 and ex.text:
            ex.backend.generate(ex.text, {"max_new_tokens": 0})
        return ProgramStateGroup([ProgramState(ex.copy()) for _ in range(size)], self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """One branch, joined back (its new variables gathered) when the block ends."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # -- streaming ---------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """With `run(stream=True)`: the text (or one variable's) as it is generated."""
        if not self.executor.stream:
            yield self.text() if var_name is None else self[var_name]
            return
        ex, seen = self.executor, 0
        while True:
            with ex.logged:
                while len(ex.log) <= seen:
                    ex.logged.wait()
                events, seen = ex.log[seen:], len(ex.log)
            for event in events:
                if event is END:
                    ex.sync()  # a failure is raised here, not swallowed
                    return
                var, piece = cast("tuple[str | None, str | None]", event)
                if var_name is None and piece:
                    yield piece
                elif var_name is not None and var == var_name:
                    if piece is None:
                        return
                    yield piece

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        pieces = self.text_iter(var_name)
        while True:
            piece = await loop.run_in_executor(None, next, pieces, None)
            if piece is None:
                return
            yield piece

    def __del__(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None and executor._thread is not None:
            executor.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of `s.fork(n)`."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states, self.parent = states, parent
        self._base_text = parent.executor.text
        self._base_vars = set(parent.executor.variables)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:  # `forks[i] += ...` assigns the same state back
            raise TypeError("a fork's branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        """Adds to every branch: one expression, one per branch (a list), or fn(i)."""
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other, strict=True):
                state += expr
        elif callable(other):
            fn: Callable[[int], Any] = other
            for i, state in enumerate(self.states):
                state += fn(i)
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable the branches made becomes a list on the parent.
        concate_and_append: the text each branch added is appended to the parent's."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be gather_variable or concate_and_append: {mode!r}")
        for state in self.states:
            state.executor.sync()
        if mode == "gather_variable":
            gathered: dict[str, list[Any]] = {}
            for state in self.states:
                for name in state.executor.variables.keys() - self._base_vars:
                    gathered.setdefault(name, []).append(state.executor.variables[name])
            self.parent.executor.sync()
            self.parent.executor.variables.update(gathered)
        else:
            self.parent += "".join(s.executor.text[len(self._base_text) :] for s in self.states)
            self.parent.executor.sync()
        for state in self.states:
            state.executor.end()
