"""The hostile inputs of issue 16: each must be answered 4xx, and leave every service up.

Each is sent as raw bytes (some are not valid JSON, or not UTF-8), so the client adds nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

MB = 1 << 20
DEPTH = 1000


@dataclass(frozen=True)
class Hostile:
    name: str
    path: str
    body: bytes


def _gen(**sampling: Any) -> bytes:
    params = {"max_new_tokens": 4, "temperature": 0, **sampling}
    return json.dumps({"text": "Say something.", "sampling_params": params}).encode()


# Two schemas that only reference each other: no finite JSON value matches either.
MUTUAL = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "$ref": "#/$defs/a",
}

HOSTILE = [
    Hostile("regex matching nothing", "/generate", _gen(regex=r"[^\s\S]")),
    Hostile("left-recursive ebnf", "/generate", _gen(ebnf="root ::= root")),
    Hostile("self-referencing schema", "/generate", _gen(json_schema={"$ref": "#"})),
    Hostile("mutually referencing schemas", "/generate", _gen(json_schema=MUTUAL)),
    Hostile("top_p 1e-165", "/generate", _gen(top_p=1e-165, temperature=1.0)),
    Hostile(
        "invalid UTF-8 body", "/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}'
    ),
    # Nested where the API takes any JSON (a schema object), so only depth can refuse it.
    Hostile(
        "1,000-deep nesting",
        "/generate",
        b'{"text": "x", "sampling_params": {"max_new_tokens": 4, "json_schema": '
        + b'{"a": ' * DEPTH
        + b"{}"
        + b"}" * DEPTH
        + b"}}",
    ),
    Hostile(
        "10 MB prompt",
        "/v1/completions",
        json.dumps({"prompt": "a " * (5 * MB), "max_tokens": 4}).encode(),
    ),
    Hostile("10 MB /tokenize body", "/tokenize", json.dumps({"text": "a " * (5 * MB)}).encode()),
]


@dataclass
class Answer:
    name: str
    status: int | None  # None: no answer (connection error or timeout)
    seconds: float
    detail: str


async def send_hostile(
    session: aiohttp.ClientSession, base_url: str, h: Hostile, timeout: float
) -> Answer:
    start = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    try:
        async with session.post(
            base_url + h.path,
            data=h.body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            text = await resp.text(errors="replace")
            return Answer(h.name, resp.status, time.perf_counter() - start, text[:300])
    except (aiohttp.ClientError, TimeoutError) as e:
        return Answer(h.name, None, time.perf_counter() - start, f"{type(e).__name__}: {e}")
