"""`radixserve-loadtest burst`: N requests sent at once to a running server; what came back.

    radixserve-loadtest burst --base-url http://127.0.0.1:8000 --n 2000 --max-tokens 16 \
        --retry --out burst.json

Counts each request's final status (2xx, 429, 503, other 4xx / 5xx, connection errors, hung:
no answer within --hang-timeout), how many 429/503 answers carried Retry-After, and latency
percentiles. With --retry a 429/503 is sent again after its Retry-After, within the hang bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadtest.attempt import KINDS, Outcome, send

ENDPOINTS = {"completions": "/v1/completions", "generate": "/generate"}
PERCENTILES = (50, 90, 99)
FIRST_ERRORS = 5


def request_body(
    endpoint: str, prompt: str, max_tokens: int, model: str | None = None
) -> dict[str, Any]:
    """A non-streaming request that generates exactly max_tokens tokens (EOS ignored), so
    every request of a burst costs the server the same."""
    if endpoint == "generate":
        params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return {"text": prompt, "sampling_params": params}
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if model is not None:
        body["model"] = model
    return body


def prompts(n: int, text: str, repeat: int, unique: bool) -> list[str]:
    """n prompts of text repeated; with unique, each ends with its index, so the radix cache
    serves only their shared prefix."""
    base = " ".join([text] * repeat)
    return [f"{base} {i}" if unique else base for i in range(n)]


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float] | None:
    if not seconds:
        return None
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    out = {f"p{p}": round(float(np.percentile(ms, p)), 2) for p in PERCENTILES}
    out["max"] = round(float(ms.max()), 2)
    return out


def summarize(outcomes: Sequence[Outcome], duration_s: float) -> dict[str, Any]:
    """The burst's figures: final status counts, refusals and retries, latencies."""
    counts = Counter(o.kind for o in outcomes)
    errors = [o.error for o in outcomes if o.kind != "2xx" and o.error]
    return {
        "requests": len(outcomes),
        "duration_s": round(duration_s, 3),
        "counts": {k: counts.get(k, 0) for k in KINDS},
        "refusals": sum(o.refusals for o in outcomes),
        "refusals_with_retry_after": sum(o.refusals_with_retry_after for o in outcomes),
        "retried_ok": sum(o.retried_ok for o in outcomes),
        "latency_ms_ok": percentiles_ms([o.latency_s for o in outcomes if o.kind == "2xx"]),
        "latency_ms_all": percentiles_ms([o.latency_s for o in outcomes if o.kind != "hung"]),
        "first_errors": errors[:FIRST_ERRORS],
    }


def table(summary: dict[str, Any]) -> str:
    lines = [f"{summary['requests']} requests in {summary['duration_s']:.2f} s"]
    lines += [f"  {kind:<12} {n:>7}" for kind, n in summary["counts"].items()]
    lines.append(
        f"  429/503 answers: {summary['refusals']} "
        f"({summary['refusals_with_retry_after']} with Retry-After); "
        f"ok after a retry: {summary['retried_ok']}"
    )
    for key, label in (("latency_ms_ok", "2xx"), ("latency_ms_all", "answered")):
        lat = summary[key]
        if lat is not None:
            cells = ", ".join(f"{k} {v:.0f}" for k, v in lat.items())
            lines.append(f"  latency of {label} (ms): {cells}")
    lines += [f"  error: {e}" for e in summary["first_errors"]]
    return "\n".join(lines)


async def burst(args: argparse.Namespace) -> dict[str, Any]:
    url = args.base_url.rstrip("/") + ENDPOINTS[args.endpoint]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    bodies = [
        request_body(args.endpoint, p, args.max_tokens, args.model)
        for p in prompts(args.n, args.prompt, args.prompt_repeat, not args.same_prompt)
    ]
    # One session, no connection cap (aiohttp's default of 100 would queue the burst in the
    # client); every request starts at once.
    connector = aiohttp.TCPConnector(limit=0)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=connector) as session:
        started = loop.time()
        outcomes = await asyncio.gather(
            *(send(session, url, b, args.hang_timeout, args.retry, headers) for b in bodies)
        )
        duration = loop.time() - started
    summary = summarize(outcomes, duration)
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    p.add_argument("--n", type=int, default=256, help="requests sent at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    p.add_argument("--prompt-repeat", type=int, default=1, help="the prompt text K times")
    p.add_argument("--same-prompt", action="store_true", help="no per-request suffix")
    p.add_argument("--model", default=None, help="the model field (default: none sent)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument(
        "--hang-timeout", type=float, default=300.0, help="seconds without an answer: hung"
    )
    p.add_argument("--retry", action="store_true", help="resend 429/503 after Retry-After")
    p.add_argument("--out", type=Path, default=None, help="write the JSON summary here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.n < 1 or args.max_tokens < 1 or args.prompt_repeat < 1:
        raise SystemExit("--n, --max-tokens and --prompt-repeat must be at least 1")
    summary = asyncio.run(burst(args))
    print(table(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return summary
