"""`radixserve-loadtest protocols`: gRPC against HTTP on one running server, in one run.

    radixserve-loadtest protocols --base-url http://127.0.0.1:8000 \\
        --grpc-target 127.0.0.1:50051 --out results/protocols.json

Three workloads, each sent through every protocol in turn (HTTP's native /generate with SSE,
`grpc`: radixserve.v1's StreamGenerate, `grpc-smg`: SMG's worker protocol), the order rotated
every round so no protocol always runs first or last:

- one-token requests at concurrency 1, the protocols taking turns request by request (so a
  slow moment of the machine falls on all of them alike): the median request latency is the
  protocol's per-request overhead on top of one prefill and one sampled token;
- one-token requests at concurrency 64: the same under many requests at once;
- decode-heavy: 64 prompts of 128 tokens, 512 out, all at once: output tokens per second.

Every run's prompts are fresh text (no run is helped by another's prefix cache). The report
gives each protocol's medians over the rounds and the ratios to HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import datasets, tokenizer
from loadtest.backends import BACKENDS, Options, RequestResult
from loadtest.grpc_backends import GRPC_BACKENDS
from loadtest.metrics import compute
from loadtest.runner import Client, arrival_times, converse, run
from loadtest.serving import grpc_channel, resolve_tokenizer
from loadtest.textgen import TextSource

PROTOCOLS = ["radixserve", "grpc", "grpc-smg"]
# name -> (requests, concurrency, input tokens, output tokens)
WORKLOADS: dict[str, tuple[int, int, int, int]] = {
    "one_token_c1": (100, 1, 32, 1),
    "one_token_c64": (640, 64, 32, 1),
    "decode_heavy": (64, 64, 128, 512),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--grpc-target", default="127.0.0.1:50051")
    p.add_argument("--tokenizer", default="", help="default: the server's (GET /get_model_info)")
    p.add_argument("--api-key", default="")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--protocols", default=",".join(PROTOCOLS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiply every workload's request count"
    )
    p.add_argument(
        "--decode-len",
        type=int,
        default=WORKLOADS["decode_heavy"][3],
        help="decode_heavy's output tokens a request",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/protocols.json")


async def one_run(
    client: Client,
    source: TextSource,
    workload: str,
    scale: float,
    decode_len: int | None = None,
) -> dict[str, Any]:
    n, concurrency, in_len, out_len = WORKLOADS[workload]
    n = max(1, round(n * scale))
    if workload == "decode_heavy" and decode_len is not None:
        out_len = decode_len
    client = dataclasses.replace(client, max_concurrency=concurrency)
    convs = datasets.random_dataset(source, random.Random(), n, in_len, out_len, 1.0)
    done = await run(client, convs, arrival_times(n, float("inf"), 0))
    return _result(compute(done.results, done.duration_s, source.count), n, concurrency)


async def interleaved(
    clients: dict[str, Client], order: list[str], tok: Any, seed: int, scale: float
) -> dict[str, dict[str, Any]]:
    """one_token_c1 with the protocols taking turns, request by request: each protocol's
    result, as one_run gives it."""
    n, _, in_len, out_len = WORKLOADS["one_token_c1"]
    n = max(1, round(n * scale))
    convs = {
        name: datasets.random_dataset(
            TextSource(tok, seed + 97 * i), random.Random(), n, in_len, out_len, 1.0
        )
        for i, name in enumerate(order)
    }
    results: dict[str, list[RequestResult]] = {name: [] for name in order}
    started = {name: 0.0 for name in order}
    for k in range(n):
        for name in order:
            t0 = time.perf_counter()
            await converse(clients[name], convs[name][k], results[name].append)
            started[name] += time.perf_counter() - t0
    out = {}
    for name in order:
        m = compute(results[name], started[name], clients[name].count_tokens)
        out[name] = _result(m, n, 1)
    return out


def _result(m: Any, n: int, concurrency: int) -> dict[str, Any]:
    assert m.e2e is not None
    return {
        "requests": n,
        "concurrency": concurrency,
        "failed": m.failed,
        "errors": m.errors,
        "median_latency_ms": m.e2e.median,
        "p99_latency_ms": m.e2e.p99,
        "median_ttft_ms": m.ttft.median if m.ttft else None,
        "output_tokens": m.total_output_tokens,
        "output_tok_s": m.output_throughput,
        "request_s": m.request_throughput,
    }


async def measure(a: argparse.Namespace) -> dict[str, Any]:
    protocols = a.protocols.split(",")
    workloads = a.workloads.split(",")
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
    async with (
        aiohttp.ClientSession(connector=connector, headers=headers) as session,
        grpc_channel(a.grpc_target, a.api_key or None) as channel,
    ):
        args = argparse.Namespace(tokenizer=a.tokenizer)
        tok = tokenizer.load(await resolve_tokenizer(args, session, a.base_url))
        clients = {}
        for name in protocols:
            backend = GRPC_BACKENDS[name](tok) if name in GRPC_BACKENDS else BACKENDS[name]()
            url = a.base_url + backend.path
            options = Options(model="", temperature=0.0)
            count = lambda text: len(tok.encode(text).ids)  # noqa: E731
            clients[name] = Client(session, url, backend, options, None, count, channel)
        for i, name in enumerate(protocols):  # warm every path (and the server) first
            await one_run(clients[name], TextSource(tok, a.seed + 1000 + i), "one_token_c1", 0.1)
        runs: list[dict[str, Any]] = []
        for r in range(a.rounds):
            order = protocols[r % len(protocols) :] + protocols[: r % len(protocols)]
            for workload in workloads:
                seed = a.seed + 7919 * r + 31 * len(runs)
                if workload == "one_token_c1":
                    results = await interleaved(clients, order, tok, seed, a.scale)
                else:
                    results = {}
                    for name in order:
                        source = TextSource(tok, seed + 97 * len(results))
                        results[name] = await one_run(
                            clients[name], source, workload, a.scale, a.decode_len
                        )
                for name in order:
                    result = results[name]
                    runs.append({"round": r, "protocol": name, "workload": workload, **result})
                    print(
                        f"round {r} {workload:<14} {name:<11} "
                        f"median {result['median_latency_ms']:8.1f} ms  "
                        f"{result['output_tok_s']:8.1f} out tok/s  failed {result['failed']}",
                        flush=True,
                    )
    return {"runs": runs, "summary": summarize(runs, protocols, workloads)}


def summarize(
    runs: list[dict[str, Any]], protocols: list[str], workloads: list[str]
) -> dict[str, Any]:
    """Per workload and protocol, the median over rounds; and each protocol over HTTP's."""
    out: dict[str, Any] = {}
    for w in workloads:
        row: dict[str, Any] = {}
        for p in protocols:
            mine = [x for x in runs if x["workload"] == w and x["protocol"] == p]
            row[p] = {
                "median_latency_ms": statistics.median(x["median_latency_ms"] for x in mine),
                "output_tok_s": statistics.median(x["output_tok_s"] for x in mine),
                "failed": sum(x["failed"] for x in mine),
            }
        base = row.get("radixserve")
        if base:
            for p in protocols:
                row[p]["latency_over_http"] = round(
                    row[p]["median_latency_ms"] / base["median_latency_ms"], 4
                )
                row[p]["tok_s_over_http"] = round(row[p]["output_tok_s"] / base["output_tok_s"], 4)
        out[w] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="radixserve-loadtest protocols", description=__doc__)
    add_arguments(p)
    a = p.parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    result = asyncio.run(measure(a))
    record = {"time": started, "config": vars(a), **result}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(result["summary"], indent=1))
    return record
