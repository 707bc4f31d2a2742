"""Every detokenizer SIGKILLed mid-stream, with separate service processes: the partitions'
new owners (a standby started here, or the supervisor's restarted children) replay the open
requests, and each request ends with exactly the text of an uninterrupted run: nothing hangs,
nothing is lost, no chunk arrives twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import redis

from loadtest.fault_stack import RedisServer, Stack, wait_for
from services.detokenizer.lease import lease_key
from shared import constants
from shared.messages.heartbeat import Heartbeat
from tests.e2e.stack import sse_events
from tests.executor.helpers import write_tiny_model

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PARTITIONS = 2
PROMPTS = [f"the thin {w} in the sea {i}" for i, w in enumerate("abcdefgh")]
# Long enough that no request can finish while the last is still waiting for its first
# chunk (the fault must find all of them mid-stream): at 96, a request sometimes ended first
# when the suite ran on two busy workers.
MAX_TOKENS = 384
# Far above a takeover's few seconds; the partition the standby does not take waits for the
# supervisor to restart its owner (a new process loading a tokenizer on a busy box).
HANG_S = 60.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = write_tiny_model(tmp_path_factory.mktemp("detok-model"), "llama", 11)
    server = RedisServer()
    server.start()
    args = ["--model", str(model), "--device", "cpu", "--max-total-tokens", "8192"]
    args += ["--detokenizer-partitions", str(PARTITIONS)]
    s = Stack(server, args, tmp_path_factory.mktemp("detok-logs"))
    try:
        s.start(timeout=300)
        # A standby without --partition: it owns nothing until a partition's owner dies.
        log = open(s.log_dir / "standby.log", "ab")  # noqa: SIM115 - the child writes it
        cmd = [sys.executable, "-m", "radixserve", "detokenizer", "--model", str(model)]
        cmd += ["--detokenizer-partitions", str(PARTITIONS)]
        s.extra.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=s.env(), start_new_session=True
            )
        )
        wait_for(lambda: s.extra[0].pid in live_pids(s), 120, "the standby's heartbeat")
        yield s
    finally:
        s.stop()
        server.close()


def live_pids(s: Stack) -> list[int]:
    r = redis.Redis.from_url(s.redis.url)
    decode = msgspec.msgpack.Decoder(Heartbeat).decode
    try:
        keys = r.keys(constants.live_key("detokenizer", "*"))
        return [decode(v).pid for v in r.mget(keys) if v] if keys else []
    finally:
        r.close()


def holders(s: Stack) -> list[int | None]:
    """The pid of each partition's owner (from its lease and its heartbeat)."""
    r = redis.Redis.from_url(s.redis.url)
    decode = msgspec.msgpack.Decoder(Heartbeat).decode
    try:
        out: list[int | None] = []
        for p in range(PARTITIONS):
            holder = r.get(lease_key(p))
            beat = r.get(constants.live_key("detokenizer", holder.decode())) if holder else None
            out.append(decode(beat).pid if beat else None)
        return out
    finally:
        r.close()


async def stream_completion(
    session: aiohttp.ClientSession,
    s: Stack,
    model: str,
    prompt: str,
    progress: dict[str, int],
    max_tokens: int = MAX_TOKENS,
) -> tuple[str, int]:
    """Streamed text (the chunks joined) and the completion tokens the usage reports."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, tokens = "", -1
    async with session.post(f"{s.base_url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse_events(resp):
            if event["choices"]:
                text += event["choices"][0]["text"]
                progress[prompt] = progress.get(prompt, 0) + 1
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return text, tokens


async def run_all(
    s: Stack,
    model: str,
    on_started: Any = None,
    max_tokens: int = MAX_TOKENS,
    *,
    early_ok: bool = False,
) -> list[tuple[str, int]]:
    """PROMPTS streamed at once; on_started() once each has streamed a chunk and none has
    finished. A request may finish before another's first chunk (a fast machine, an uneven
    split between executors): early_ok then skips on_started (the caller sees it was not
    called and runs again); otherwise that fails."""
    progress: dict[str, int] = {}
    timeout = aiohttp.ClientTimeout(total=HANG_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        jobs = [
            asyncio.create_task(stream_completion(session, s, model, p, progress, max_tokens))
            for p in PROMPTS
        ]
        if on_started is not None:
            # Every request is mid-generation: each has streamed a chunk, none has finished.
            while len(progress) < len(PROMPTS) and not any(j.done() for j in jobs):
                await asyncio.sleep(0.02)
            ended = [PROMPTS[i] for i, j in enumerate(jobs) if j.done()]
            if not ended:
                on_started()
            elif not early_ok:
                raise AssertionError(f"requests ended before the fault: {ended}, {progress}")
        return await asyncio.gather(*jobs)


def test_killed_detokenizers_lose_no_request_and_repeat_no_text(stack: Stack) -> None:
    with urllib.request.urlopen(f"{stack.base_url}/v1/models") as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    reference = asyncio.run(run_all(stack, model))
    assert all(tokens == MAX_TOKENS and text for text, tokens in reference)
    before = holders(stack)
    assert all(before), before
    killed: list[int] = []

    def kill_every_owner() -> None:
        for pid in holders(stack):
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    faulted = asyncio.run(run_all(stack, model, on_started=kill_every_owner))
    assert len(killed) == PARTITIONS
    assert faulted == reference  # same text, chunk by chunk joined; same token counts
    # Only the partitions that had requests open had to be taken for the run to end; a
    # restarted owner of one that had none may still be loading its tokenizer.
    wait_for(
        lambda: all(pid is not None and pid not in killed for pid in holders(stack)),
        HANG_S,
        f"new owners of all {PARTITIONS} partitions (killed: {killed})",
    )
    # The standby and the supervisor's restarted children race for the free leases (which
    # wins is a matter of timing); whichever lost stands by, alive.
    assert stack.extra[0].poll() is None
    assert "Traceback" not in Path(stack.log_dir / "standby.log").read_text(errors="replace")
