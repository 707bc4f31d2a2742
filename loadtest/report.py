"""Presenting a run: the summary table, one JSON line per run, and optional PNG plots."""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest.backends import RequestResult
from loadtest.metrics import Distribution, Metrics, latencies, throughput_timeline

WIDTH = 50
SECTIONS = [
    ("ttft", "Time to First Token", "TTFT"),
    ("itl", "Inter-Token Latency", "ITL"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("e2e", "End-to-End Latency", "E2E Latency"),
]


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label + ':':<40} {value:>10}"


def summary(m: Metrics, config: dict[str, Any]) -> str:
    """The table SGLang's bench_serving prints, plus cache hit rate and the first errors."""
    hit = "n/a" if m.cache_hit_rate is None else f"{100 * m.cache_hit_rate:.1f}%"
    lines = [
        " Serving Benchmark Result ".center(WIDTH, "="),
        _row("Backend", config["backend"]),
        _row("Dataset", config["dataset_name"]),
        _row("Traffic request rate", str(config["request_rate"])),
        _row("Max request concurrency", config["max_concurrency"] or "not set"),
        _row("Successful requests", m.completed),
        _row("Failed requests", m.failed),
        _row("Benchmark duration (s)", m.duration_s),
        _row("Total input tokens", m.total_input_tokens),
        _row("Total generated tokens", m.total_output_tokens),
        f"  (token counts from {m.token_counts})",
        _row("Request throughput (req/s)", m.request_throughput),
        _row("Input token throughput (tok/s)", m.input_throughput),
        _row("Output token throughput (tok/s)", m.output_throughput),
        _row("Total token throughput (tok/s)", m.total_throughput),
        _row("Concurrency", m.concurrency),
        _row("Cache hit rate", hit),
    ]
    for key, title, short in SECTIONS:
        dist: Distribution | None = getattr(m, key)
        lines.append(title.center(WIDTH, "-"))
        if dist is None:
            lines.append(_row(f"{short} (ms)", "n/a"))
            continue
        lines += [
            _row(f"Mean {short} (ms)", dist.mean),
            _row(f"Median {short} (ms)", dist.median),
            _row(f"P90 {short} (ms)", dist.p90),
            _row(f"P95 {short} (ms)", dist.p95),
            _row(f"P99 {short} (ms)", dist.p99),
        ]
    if m.hop_median_ms:
        lines.append("First token, per hop (median ms)".center(WIDTH, "-"))
        lines += [_row(stage, ms) for stage, ms in m.hop_median_ms.items()]
    lines.append("=" * WIDTH)
    if m.errors:
        lines.append(f"First {len(m.errors)} errors:")
        lines += [f"  {e}" for e in m.errors]
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    """JSON has no Infinity: an infinite request rate is written as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, Path):
        return str(value)
    return value


def append_jsonl(path: Path, m: Metrics, config: dict[str, Any]) -> dict[str, Any]:
    """Append one object (date, config, every metric) as a line of `path`; return it."""
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {k: _jsonable(v) for k, v in config.items()},
        **m.to_json(),
    }
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def pyplot() -> Any:
    """matplotlib.pyplot, imported only when plots are asked for (an optional dependency)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot-dir needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot(
    plot_dir: Path,
    results: Sequence[RequestResult],
    started: float,
    duration_s: float,
    count_tokens: Callable[[str], int],
) -> list[Path]:
    """latency_cdf.png (TTFT, ITL, TPOT, E2E) and throughput.png (about 60 bins) in plot_dir."""
    plt = pyplot()
    plot_dir.mkdir(parents=True, exist_ok=True)
    lat = latencies([r for r in results if r.ok], count_tokens)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title, _) in zip(axes.flat, SECTIONS, strict=True):
        ms = sorted(1000.0 * v for v in getattr(lat, key))
        ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post")
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf = plot_dir / "latency_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    bin_s = max(0.1, duration_s / 60)
    times, tokens, done = throughput_timeline(results, started, count_tokens, bin_s)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.step(times, tokens, where="post", label="output tokens/s")
    ax.set(xlabel="seconds since start", ylabel="output tokens/s", ylim=(0, None))
    ax.set_title(f"Throughput over time ({bin_s:.2g} s bins)")
    ax2 = ax.twinx()
    ax2.step(times, done, where="post", color="tab:orange", label="completed requests/s")
    ax2.set(ylabel="completed requests/s", ylim=(0, None))
    fig.legend(loc="upper left", bbox_to_anchor=(0.07, 0.88))
    fig.tight_layout()
    tput = plot_dir / "throughput.png"
    fig.savefig(tput, dpi=100)
    plt.close(fig)
    return [cdf, tput]
