"""Where a program's generations run: radixserve in this process (`radixserve.Engine`), or a
radixserve server over HTTP (`RuntimeEndpoint`). Both speak /generate's fields and shapes, so
the rest of the language is written once against `Backend`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Protocol

Result = dict[str, Any]


class BackendError(RuntimeError):
    """The backend refused or failed a request; the message is its own."""


class Backend(Protocol):
    def generate(self, text: str | list[str], sampling: dict[str, Any], **opts: Any) -> Any: ...

    def generate_stream(
        self, text: str, sampling: dict[str, Any], **opts: Any
    ) -> Iterator[Result]: ...

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str: ...

    def flush_cache(self) -> None: ...

    def get_server_info(self) -> dict[str, Any]: ...


class RuntimeEndpoint:
    """A radixserve server (or any server with SGLang's /generate) at `base_url`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.base_url, self.api_key, self.timeout_s = base_url.rstrip("/"), api_key, timeout_s
        self.model_info = self._call("GET", "/get_model_info")

    def _request(self, method: str, path: str, body: Any = None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request(
            self.base_url + path, data=data, headers=headers, method=method
        )

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            with urllib.request.urlopen(
                self._request(method, path, body), timeout=self.timeout_s
            ) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise BackendError(_error_text(e.read(), e.code)) from None

    def generate(self, text: str | list[str], sampling: dict[str, Any], **opts: Any) -> Any:
        return self._call("POST", "/generate", {"text": text, "sampling_params": sampling, **opts})

    def generate_stream(self, text: str, sampling: dict[str, Any], **opts: Any) -> Iterator[Result]:
        body = {"text": text, "sampling_params": sampling, "stream": True, **opts}
        try:
            resp = urllib.request.urlopen(
                self._request("POST", "/generate", body), timeout=self.timeout_s
            )
        except urllib.error.HTTPError as e:
            raise BackendError(_error_text(e.read(), e.code)) from None
        with resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise BackendError(event["error"].get("message", str(event)))
                yield event

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The model's chat template applied by the server: its tokens, as text."""
        ids = self._call(
            "POST",
            "/tokenize",
            {"messages": messages, "add_generation_prompt": add_generation_prompt},
        )["tokens"]
        text: str = self._call(
            "POST", "/detokenize", {"tokens": ids, "skip_special_tokens": False}
        )["text"]
        return text

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._call("GET", "/get_server_info")
        return info


class EngineBackend:
    """A `radixserve.Engine` in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, text: str | list[str], sampling: dict[str, Any], **opts: Any) -> Any:
        try:
            return self.engine.generate(text, sampling, **opts)
        except ValueError as e:
            raise BackendError(str(e)) from None

    def generate_stream(self, text: str, sampling: dict[str, Any], **opts: Any) -> Iterator[Result]:
        try:
            yield from self.engine.generate(text, sampling, stream=True, **opts)
        except ValueError as e:
            raise BackendError(str(e)) from None

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        tokenizer = self.engine.tokenization.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise BackendError("this model has no chat template: roles need one")
        text: str = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return text

    def flush_cache(self) -> None:
        if not self.engine.flush_cache():
            raise BackendError("the cache cannot be flushed while requests run")

    def get_server_info(self) -> dict[str, Any]:
        return {
            "model": self.engine.get_model_info(),
            "in_flight": self.engine.pipeline.in_flight(),
        }


def as_backend(value: Any) -> Backend:
    """A backend from what the user gave: a backend, or a radixserve.Engine."""
    if hasattr(value, "generate_stream") and hasattr(value, "render_chat"):
        backend: Backend = value
        return backend
    if hasattr(value, "pipeline") and hasattr(value, "generate"):
        return EngineBackend(value)
    raise TypeError(f"not a backend: {type(value).__name__} (use a RuntimeEndpoint or an Engine)")


def _error_text(raw: bytes, status: int) -> str:
    try:
        body = json.loads(raw)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {raw[:200]!r}"
