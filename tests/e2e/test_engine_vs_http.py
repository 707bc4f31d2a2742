"""The in-process Engine and `radixserve serve` on the same weights answer alike: the same
greedy output for the same /generate request, the same refusal for the same bad one."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine, RequestError
from tests.e2e.stack import Stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with Engine(str(tiny_model_dir), device="cpu", max_total_tokens=8192, show_progress=False) as e:
        yield e


def post(stack: Stack, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"{stack.base_url}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


REQUESTS = [
    {"text": "the thin cat", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
    {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    {
        "text": "the sea",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop": ["e"]},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    },
    {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    },
]


@pytest.mark.parametrize("body", REQUESTS)
def test_the_engine_answers_what_the_http_api_answers(
    engine: Engine, tiny_stack: Stack, body: dict[str, Any]
) -> None:
    status, http = post(tiny_stack, body)
    assert status == 200, http
    options = {k: v for k, v in body.items() if k not in ("text", "sampling_params", "input_ids")}
    local = engine.generate(
        body.get("text"), body["sampling_params"], body.get("input_ids"), **options
    )

    def comparable(r: dict[str, Any]) -> dict[str, Any]:
        meta = {k: v for k, v in r["meta_info"].items() if k not in ("id", "cached_tokens")}
        return {**r, "meta_info": meta}

    if isinstance(http, list):
        assert [comparable(r) for r in local] == [comparable(r) for r in http]
    else:
        got, want = comparable(local), comparable(http)
        for key in ("input_token_logprobs", "output_token_logprobs"):  # fp32 sums may differ
            for a, b in zip(
                got["meta_info"].pop(key, []), want["meta_info"].pop(key, []), strict=True
            ):
                assert a[1:] == b[1:] and (a[0] is None) == (b[0] is None)
                assert a[0] is None or abs(a[0] - b[0]) < 1e-4
        for key in ("input_top_logprobs", "output_top_logprobs"):
            got["meta_info"].pop(key, None), want["meta_info"].pop(key, None)
        assert got == want


@pytest.mark.parametrize(
    "body",
    [
        {"text": "x", "sampling_params": {"temperature": -1}},
        {"text": "x", "sampling_params": {"top_k": 0}},
        {"text": "x", "sampling_params": {"regex": "[^\\s\\S]"}},
        {"text": "x", "sampling_params": {"max_new_tokens": 5000}},
        {"text": "x", "sampling_params": {"stop_regex": "("}},
    ],
)
def test_the_engine_refuses_what_the_http_api_refuses(
    engine: Engine, tiny_stack: Stack, body: dict[str, Any]
) -> None:
    status, http = post(tiny_stack, body)
    assert status == 400, http
    with pytest.raises(RequestError) as e:
        engine.generate(body["text"], body["sampling_params"])
    assert str(e.value) == http["error"]["message"]
    assert e.value.param == http["error"]["param"]
