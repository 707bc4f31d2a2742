"""Runs one program state's expressions, in order, on a thread of its own.

`s += expr` only queues `expr`; reading the state (`s["x"]`, `s.text()`) waits for the queue
to drain. So a program's Python code runs ahead of its generations, and the branches of a
`fork` generate at the same time, each on its own thread, sharing the server's batch.
"""

from __future__ import annotations

import math
import queue
import random
import threading
from typing import Any

from radixserve.lang.backends import Backend
from radixserve.lang.ir import DTYPE_REGEX, Expr, Gen, RoleBegin, RoleEnd, Select, Text

# SGLang's frontend names -> /generate's sampling_params names.
_RENAMED = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
_LOGPROB_OPTIONS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)
_END = object()  # the program's function returned: its thread may stop
_MARK = "@@radixserve-role-content@@"  # stands for a message's content, to cut a role's header


class ProgramError(RuntimeError):
    """A generation (or a select) of the program failed; raised where the state is read."""


class Executor:
    def __init__(self, backend: Backend, defaults: dict[str, Any], stream: bool) -> None:
        self.backend, self.defaults, self.stream = backend, defaults, stream
        self.text = ""
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.head = ""  # text before the first role: kept ahead of the rendered conversation
        self.role: str | None = None
        self.role_start = 0
        self.error: BaseException | None = None
        # With stream=True, what happened, in order: (variable or None, text) as text is added;
        # (variable, None) when a variable is complete; END when the program is. A list, not a
        # queue, so that every reader (text_iter, for the text or for one variable) sees it all.
        self.log: list[tuple[str | None, str | None] | object] = []
        self.logged = threading.Condition()
        self._queue: queue.Queue[Expr | object] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- the program's thread ----------------------------------------------------------------
    def submit(self, expr: Expr | object) -> None:
        with self._lock:
            if self._thread is None:  # started on demand, and again after the program ended
                self._thread = threading.Thread(
                    target=self._run, name="radixserve-lang", daemon=True
                )
                self._thread.start()
            self._queue.put(expr)

    def wait(self) -> None:
        """Wait for every queued expression."""
        self._queue.join()

    def sync(self) -> None:
        """Wait for every queued expression; raise the first failure."""
        self.wait()
        if self.error is not None:
            raise ProgramError(str(self.error)) from self.error

    def end(self) -> None:
        self.submit(_END)

    def copy(self) -> Executor:
        """A branch: this state's text, variables, conversation and role, as of now."""
        other = Executor(self.backend, self.defaults, self.stream)
        other.text, other.head = self.text, self.head
        other.variables, other.meta_info = dict(self.variables), dict(self.meta_info)
        other.messages = [dict(m) for m in self.messages]
        other.role, other.role_start = self.role, self.role_start
        return other

    # -- the executor's thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    self._emit(_END)
                    with self._lock:
                        if self._queue.empty():
                            self._thread = None
                            return
                elif self.error is None:  # after a failure the rest is skipped, not run
                    self._execute(expr)
            except Exception as e:
                self.error = e
                self._emit(_END)
            finally:
                self._queue.task_done()

    def _execute(self, expr: Any) -> None:
        if isinstance(expr, Text):
            self._append(expr.text, None)
        elif isinstance(expr, Gen):
            if expr.params.get("choices") is not None:
                self._select(Select(expr.name, list(expr.params["choices"])))
            else:
                self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _append(self, text: str, var: str | None) -> None:
        self.text += text
        if self.stream and text:
            self._emit((var, text))

    def _emit(self, item: tuple[str | None, str | None] | object) -> None:
        with self.logged:
            self.log.append(item)
            self.logged.notify_all()

    def _sampling(self, gen: Gen) -> tuple[dict[str, Any], dict[str, Any]]:
        params = {**self.defaults, **{k: v for k, v in gen.params.items() if v is not None}}
        options = {k: params.pop(k) for k in _LOGPROB_OPTIONS if k in params}
        dtype = params.pop("dtype", None)
        if dtype is not None:
            name = dtype if isinstance(dtype, str) else dtype.__name__
            if name not in DTYPE_REGEX:
                raise ValueError(f"gen dtype must be int, float, str or bool, got {dtype!r}")
            params["regex"] = DTYPE_REGEX[name]
            if name in ("int", "float"):  # as SGLang's frontend: a number ends at a space
                params["stop"] = [*_as_list(params.get("stop")), " ", "\n"]
        params.pop("choices", None)
        sampling = {_RENAMED.get(k, k): v for k, v in params.items()}
        return sampling, options

    def _gen(self, gen: Gen) -> None:
        sampling, options = self._sampling(gen)
        if self.stream:
            out, meta = "", {}
            for event in self.backend.generate_stream(self.text, sampling, **options):
                piece = event["text"][len(out) :]
                out, meta = event["text"], event["meta_info"]
                self._append(piece, gen.name)
        else:
            result = self.backend.generate(self.text, sampling, **options)
            out, meta = result["text"], result["meta_info"]
            self._append(out, gen.name)
        self._set(gen.name, out, meta)

    def _set(self, name: str | None, value: str, meta: dict[str, Any]) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta_info[name] = meta
            if self.stream:
                self._emit((name, None))

    def _select(self, sel: Select) -> None:
        """SGLang's choice by token-length-normalised logprob: the prompt is cached first, then
        every choice is scored in one batch over it, from two tokens before its end (token
        healing: the first of those is dropped when the text already ends with it)."""
        prompt_len = self.backend.generate(self.text, {"max_new_tokens": 0})["meta_info"][
            "prompt_tokens"
        ]
        scored = self.backend.generate(
            [self.text + c for c in sel.choices],
            {"max_new_tokens": 0, "temperature": 0},
            return_logprob=True,
            return_text_in_logprobs=True,
            logprob_start_len=max(prompt_len - 2, 0),
        )
        scores = [_normalized(self.text, r["meta_info"]["input_token_logprobs"]) for r in scored]
        if sel.temperature <= 1e-5:
            best = max(range(len(scores)), key=lambda i: scores[i])
        else:
            top = max(scores)
            weights = [math.exp((s - top) / sel.temperature) for s in scores]
            best = random.choices(range(len(scores)), weights=weights)[0]
        choice = sel.choices[best]
        self._append(choice, sel.name)
        meta = {
            "normalized_prompt_logprobs": scores,
            "input_token_logprobs": [r["meta_info"]["input_token_logprobs"] for r in scored],
        }
        self._set(sel.name, choice, meta)

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.role!r}")
        if not self.messages and self.text and not self.head:
            self.head = self.text
        elif self.text and len(self.text) > len(self._rendered(False)):
            # text between two roles: kept, as part of the message before it
            extra = self.text[len(self._rendered(False)) :]
            if self.messages:
                self.messages[-1]["content"] += extra
        self.role = role
        self._retext(self._opened(role))
        self.role_start = len(self.text)

    def _role_end(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"role {role!r} ends, but {self.role!r} is open")
        content = self.text[self.role_start :]
        self.messages.append({"role": role, "content": content})
        self.role = None
        self._retext(self._rendered(False))

    def _retext(self, text: str) -> None:
        """The text a role's start or end re-renders: streamed as what it adds (a template's
        header or end-of-turn) when it extends the text, as chat templates do."""
        if text.startswith(self.text):
            self._append(text[len(self.text) :], None)
        self.text = text

    def _opened(self, role: str) -> str:
        """The conversation so far, then `role`'s header as the chat template writes it."""
        if role == "assistant":  # the template's generation prompt opens the assistant turn
            return self._rendered(True)
        probe = [*self.messages, {"role": role, "content": _MARK}]
        rendered = self.backend.render_chat(probe, False)
        cut = rendered.find(_MARK)
        if cut < 0:
            raise ValueError(f"the chat template drops {role!r} messages")
        return self.head + rendered[:cut]

    def _rendered(self, generation_prompt: bool) -> str:
        if not self.messages and not generation_prompt:
            return self.head
        return self.head + self.backend.render_chat(self.messages, generation_prompt)


def _normalized(text: str, entries: list[list[Any]]) -> float:
    values = [e[0] for e in entries if e[0]]
    score = sum(values) / len(values) if values else float("-inf")
    first = entries[0] if entries else None
    healed = first is not None and first[0] is not None and first[2] and text.endswith(first[2])
    if healed and first is not None and len(entries) > 1:
        score = (score * len(entries) - first[0]) / (len(entries) - 1)
    return score


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


END = _END
