"""The serving benchmark against the real stack: what it counts agrees with the server."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest

from loadtest import protocols, serving, tokenizer
from loadtest.flags import build_parser
from loadtest.textgen import TextSource
from tests.e2e.stack import Stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.mark.parametrize("backend", ["openai", "grpc", "grpc-smg"])
def test_benchmark_counts_match_the_servers_usage(
    tiny_stack: Stack, tiny_model_dir: Path, backend: str
) -> None:
    assert tiny_stack.grpc_target is not None
    args = build_parser().parse_args(
        [
            "--base-url",
            tiny_stack.base_url,
            "--grpc-target",
            tiny_stack.grpc_target,
            "--backend",
            backend,
            "--tokenizer",
            str(tiny_model_dir),
            "--dataset-name",
            "random",
            "--num-prompts",
            "6",
            "--random-input-len",
            "40",
            "--random-output-len",
            "12",
            "--random-range-ratio",
            "0.5",
            "--seed",
            "3",
            "--disable-tqdm",
        ]
    )
    metrics = asyncio.run(serving.benchmark(args))
    assert (metrics.completed, metrics.failed) == (6, 0)
    assert metrics.token_counts == "server usage"
    # The dataset the benchmark sent, rebuilt from the same seed: the server tokenized each
    # prompt to the length the client counted, and generated exactly the asked-for outputs.
    source = TextSource(tokenizer.load(str(tiny_model_dir)), 3)
    sent = serving.build_dataset(args, source, random.Random(3))
    assert metrics.total_input_tokens == sum(c.turns[0].user_len for c in sent)
    assert metrics.total_output_tokens == sum(c.turns[0].output_len for c in sent)
    assert metrics.ttft is not None and metrics.e2e is not None
    tiny_stack.wait_idle()


def test_multi_turn_through_the_stack_reuses_the_first_turn(tiny_stack: Stack) -> None:
    """Turn 2 carries turn 1's prompt and output: everything but the last sampled token of
    turn 1 (which was never fed back, so has no KV) comes from the cache."""
    import aiohttp

    async def gen(s: aiohttp.ClientSession, ids: list[int], n: int) -> dict[str, Any]:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        }
        async with s.post(f"{tiny_stack.base_url}/generate", json=body) as r:
            assert r.status == 200
            return dict(await r.json())

    async def main() -> tuple[int, int, int]:
        async with aiohttp.ClientSession() as s:
            p1 = list(range(100, 160))
            t1 = await gen(s, p1, 10)
            p2 = p1 + t1["output_ids"] + list(range(200, 215))
            t2 = await gen(s, p2, 5)
            return len(p1), len(t1["output_ids"]), t2["meta_info"]["cached_tokens"]

    prompt, output, cached = asyncio.run(main())
    assert cached == prompt + output - 1
    tiny_stack.wait_idle()


def test_a_burst_through_the_stack_completes(tiny_stack: Stack, tmp_path: Path) -> None:
    """radixserve-loadtest burst, as a user runs it: every request of the burst answered 200,
    the JSON report says so, and the executor is left with nothing leaked."""
    import json
    import subprocess
    import sys

    out = tmp_path / "burst.json"
    argv = ["burst", "--base-url", tiny_stack.base_url, "--n", "40", "--max-tokens", "4"]
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", *argv, "--hang-timeout", "120", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["counts"]["2xx"] == 40, summary
    assert summary["latency_ms_ok"] is not None
    tiny_stack.wait_idle()


def test_protocols_compares_http_and_grpc_on_one_server(
    tiny_stack: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert tiny_stack.grpc_target is not None
    out = tmp_path / "protocols.json"
    record = protocols.main(
        [
            "--base-url",
            tiny_stack.base_url,
            "--grpc-target",
            tiny_stack.grpc_target,
            "--tokenizer",
            str(tiny_model_dir),
            "--rounds",
            "2",
            "--scale",
            "0.05",
            # 512 tokens a request (the default) was 23 of the test's 30 s on 2 cores; the
            # assertions hold for any length
            "--decode-len",
            "32",
            "--out",
            str(out),
        ]
    )
    runs = record["runs"]
    assert len(runs) == 2 * 3 * 3  # rounds x workloads x protocols
    assert all(r["failed"] == 0 for r in runs)
    # each protocol went first in a different round
    firsts = {r["round"]: r["protocol"] for r in reversed(runs) if r["workload"] == "one_token_c1"}
    assert firsts == {0: "radixserve", 1: "grpc"}
    heavy = [r for r in runs if r["workload"] == "decode_heavy"]
    assert {r["requests"] for r in heavy} == {round(64 * 0.05)}
    assert {r["output_tokens"] for r in heavy} == {round(64 * 0.05) * 32}
    summary = record["summary"]["decode_heavy"]
    assert summary["radixserve"]["tok_s_over_http"] == 1.0
    assert set(summary) == {"radixserve", "grpc", "grpc-smg"}
    assert json.loads(out.read_text())["summary"] == record["summary"]
    tiny_stack.wait_idle()
