"""A client may send the same rid again once its request has ended (a retry does): each
dispatch travels under an id of its own (shared/request_ids.py), so the second request is
answered, and never receives the first one's late tokens. Before, the detokenizer took the
second registration for a redelivery of the finished first and the call hung until its
timeout."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.stack import Stack
from tests.e2e.test_control_endpoints import post

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def generate(stack: Stack, params: dict[str, Any], rid: str) -> dict[str, Any]:
    status, body = post(
        stack, "/generate", {"text": "the thin cat sat", "rid": rid, "sampling_params": params}
    )
    assert status == 200, body
    assert body["meta_info"]["id"] == rid
    return body


def test_a_rid_can_be_sent_again_once_its_request_ended(tiny_stack: Stack) -> None:
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = generate(tiny_stack, greedy, "again-1")["text"]
    assert generate(tiny_stack, greedy, "again-1")["text"] == whole
    # A stop string ends the request in the detokenizer while the executor still generates:
    # the next request under the same rid must not see those late tokens.
    stop = whole[len(whole) // 3 : len(whole) // 3 + 3]
    assert stop.strip(), whole
    cut = whole[: whole.index(stop) + len(stop)]
    for _ in range(3):
        out = generate(tiny_stack, {**greedy, "stop": [stop]}, "again-1")
        assert out["text"] == cut.removesuffix(stop)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    tiny_stack.wait_idle()
