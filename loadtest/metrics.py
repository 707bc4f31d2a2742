"""Benchmark metrics from RequestResults: pure functions, the formulas SGLang's bench_serving
uses.

TTFT: first chunk with text - send.  ITL: gaps between chunks with text (pooled over
requests).  TPOT: (e2e - ttft) / (output_tokens - 1), for requests with more than one output
token.  Throughputs divide totals over successful requests by the run's wall time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from loadtest.backends import RequestResult

PERCENTILES = (90, 95, 99)
FIRST_ERRORS = 5


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency, in milliseconds."""

    mean: float
    median: float
    std: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Distribution | None:
        if not seconds:
            return None
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p90, p95, p99 = (float(np.percentile(ms, p)) for p in PERCENTILES)
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()), p90, p95, p99)


@dataclass(frozen=True)
class Latencies:
    """Per-request (and, for ITL, per-gap) latencies in seconds of the successful requests."""

    ttft: list[float]
    itl: list[float]
    tpot: list[float]
    e2e: list[float]


@dataclass(frozen=True)
class Metrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    token_counts: str  # where the counts come from: "server usage", "client tokenizer", a mix
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float  # mean requests in flight: sum of e2e latencies / duration
    cache_hit_rate: float | None  # None: the server reported no cached tokens
    ttft: Distribution | None
    itl: Distribution | None
    tpot: Distribution | None
    e2e: Distribution | None
    errors: list[str]  # the first few
    # stage -> median ms over the requests whose server reported where their first token's
    # time went (radixserve with --hop-latency); None when none did
    hop_median_ms: dict[str, float] | None = None

    def to_json(self) -> dict[str, object]:
        """Flat, with SGLang's key names (mean_ttft_ms, p99_itl_ms, ...)."""
        out: dict[str, object] = {}
        for key, value in asdict(self).items():
            if key in ("ttft", "itl", "tpot", "e2e"):
                name = "e2e_latency" if key == "e2e" else key
                for stat, ms in (value or {}).items():
                    out[f"{stat}_{name}_ms"] = ms
            else:
                out[key] = value
        return out


def output_tokens(r: RequestResult, count_tokens: Callable[[str], int]) -> int:
    return r.usage.completion_tokens if r.usage is not None else count_tokens(r.text)


def input_tokens(r: RequestResult) -> int:
    return r.usage.prompt_tokens if r.usage is not None else r.prompt_len


def ttft(r: RequestResult) -> float:
    """Time to the first chunk with text (to the end when no text came at all)."""
    return (r.chunk_times[0] if r.chunk_times else r.end) - r.start


def latencies(ok: Sequence[RequestResult], count_tokens: Callable[[str], int]) -> Latencies:
    itl = [b - a for r in ok for a, b in zip(r.chunk_times[:-1], r.chunk_times[1:], strict=True)]
    tpot = []
    for r in ok:
        n = output_tokens(r, count_tokens)
        if n > 1:
            tpot.append((r.end - r.start - ttft(r)) / (n - 1))
    return Latencies([ttft(r) for r in ok], itl, tpot, [r.end - r.start for r in ok])


def cache_hit_rate(ok: Sequence[RequestResult]) -> float | None:
    """Σ cached / Σ prompt tokens over the requests whose usage reports cached tokens."""
    reported = [r.usage for r in ok if r.usage is not None and r.usage.cached_tokens is not None]
    prompt = sum(u.prompt_tokens for u in reported)
    if not reported or prompt == 0:
        return None
    return sum(u.cached_tokens or 0 for u in reported) / prompt


def hop_medians(ok: Sequence[RequestResult]) -> dict[str, float] | None:
    """Per stage, the median of the reported latencies, in the server's stage order."""
    reported = [r.hops for r in ok if r.hops]
    if not reported:
        return None
    stages = list(dict.fromkeys(k for h in reported for k in h))
    return {k: float(np.median([h[k] for h in reported if k in h])) for k in stages}


def token_source(num_server: int, num_total: int) -> str:
    if num_server == num_total:
        return "server usage"
    if num_server == 0:
        return "client tokenizer"
    return f"server usage ({num_total - num_server} of {num_total} by client tokenizer)"


def compute(
    results: Sequence[RequestResult], duration_s: float, count_tokens: Callable[[str], int]
) -> Metrics:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    lat = latencies(ok, count_tokens)
    total_in = sum(input_tokens(r) for r in ok)
    total_out = sum(output_tokens(r, count_tokens) for r in ok)
    with_usage = sum(r.usage is not None for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Metrics(
        completed=len(ok),
        failed=len(failed),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        token_counts=token_source(with_usage, len(ok)),
        request_throughput=len(ok) * per_s,
        input_throughput=total_in * per_s,
        output_throughput=total_out * per_s,
        total_throughput=(total_in + total_out) * per_s,
        concurrency=sum(lat.e2e) * per_s,
        cache_hit_rate=cache_hit_rate(ok),
        ttft=Distribution.of(lat.ttft),
        itl=Distribution.of(lat.itl),
        tpot=Distribution.of(lat.tpot),
        e2e=Distribution.of(lat.e2e),
        errors=[r.error or "unknown error" for r in failed[:FIRST_ERRORS]],
        hop_median_ms=hop_medians(ok),
    )


def throughput_timeline(
    results: Sequence[RequestResult],
    started: float,
    count_tokens: Callable[[str], int],
    bin_s: float = 1.0,
) -> tuple[list[float], list[float], list[float]]:
    """(bin start times, output tokens/s, completed requests/s) over the run. A request's
    tokens are spread evenly over its text chunks (a chunk may hold several tokens)."""
    ok = [r for r in results if r.ok]
    if not ok:
        return [], [], []
    nbins = int((max(r.end for r in ok) - started) // bin_s) + 1
    tokens, done = np.zeros(nbins), np.zeros(nbins)
    for r in ok:
        if r.chunk_times:
            per_chunk = output_tokens(r, count_tokens) / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[int((t - started) // bin_s)] += per_chunk
        done[int((r.end - started) // bin_s)] += 1
    times = [i * bin_s for i in range(nbins)]
    return times, list(tokens / bin_s), list(done / bin_s)
