"""`radixserve serve --api-key ... --admin-api-key ...` through every service, with the real
openai client: the keys are checked, and one client cannot abort another's request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e.stack import Stack, start_stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"
# Far more tokens than the CPU generates before the aborts land.
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(
        [
            "--model",
            str(tiny_model_dir),
            "--max-total-tokens",
            "4096",
            "--api-key",
            f"{ALICE},{BOB}",
            "--admin-api-key",
            ADMIN,
        ],
        tmp_path_factory.mktemp("logs") / "keyed-stack.log",
        None,  # its own private Redis
    )
    yield stack
    code = stack.stop()
    assert code == 0, f"serve exited with {code} on Ctrl-C\n{stack.log_tail()}"


def test_the_openai_client_needs_a_valid_key(keyed_stack: Stack) -> None:
    base = f"{keyed_stack.base_url}/v1"
    wrong = openai.OpenAI(base_url=base, api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model="any", prompt="Hello", max_tokens=2)
    assert e.value.status_code == 401
    client = openai.OpenAI(base_url=base, api_key=ALICE, max_retries=0)
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    assert resp.choices[0].finish_reason == "length"


def test_a_client_cannot_abort_another_clients_request(keyed_stack: Stack) -> None:
    base = keyed_stack.base_url

    async def main() -> tuple[list[Any], list[tuple[int, Any]], dict[str, Any]]:
        body = {"input_ids": [9, 8, 7, 6, 5], "stream": True, "sampling_params": LONG}
        body["rid"] = "alice-long"
        answers: list[tuple[int, Any]] = []
        events: list[dict[str, Any]] = []
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{base}/generate", json=body, headers=bearer(ALICE)) as r,
        ):
            assert r.status == 200
            async for raw in r.content:
                if not raw.startswith(b"data: {"):
                    continue
                events.append(json.loads(raw.removeprefix(b"data: ")))
                if len(events) != 2:
                    continue
                # It is decoding: bob may not end it, nor find out it exists; alice may.
                for key in (BOB, ALICE):
                    async with s.post(
                        f"{base}/abort_request", json={"rid": "alice-long"}, headers=bearer(key)
                    ) as a:
                        answers.append((a.status, await a.json()))
            async with s.get(f"{base}/get_server_info", headers=bearer(BOB)) as i:
                assert i.status == 200
                info = await i.json()
        return events, answers, info

    events, answers, info = asyncio.run(main())
    (bob_status, bob_error), alice = answers
    assert bob_status == 404 and "no request with rid 'alice-long'" in bob_error["error"]["message"]
    assert alice == (200, {"aborted": ["alice-long"]})
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort", "matched": None}
    assert events[-1]["meta_info"]["completion_tokens"] < 3000
    # A user's view of the server names no instance, pid, path or URL.
    text = json.dumps(info)
    assert "pid" not in text and "redis" not in text and "/" not in json.dumps(info["instances"])
    assert info["instances"]["executor"] == 1


def test_flush_cache_is_the_admins(keyed_stack: Stack) -> None:
    async def flush(s: aiohttp.ClientSession, key: str) -> int:
        url = f"{keyed_stack.base_url}/flush_cache"
        async with s.post(url, json={}, headers=bearer(key)) as r:
            return r.status

    async def main() -> tuple[int, int]:
        async with aiohttp.ClientSession() as s:
            user = await flush(s, BOB)
            loop = asyncio.get_running_loop()
            until = loop.time() + 10
            # 400 while an executor's last heartbeat still counts the aborted request
            while (admin := await flush(s, ADMIN)) == 400 and loop.time() < until:
                await asyncio.sleep(0.2)
        return user, admin

    assert asyncio.run(main()) == (403, 200)
