"""What metrics and tracing cost on the GPU: the decode-heavy workload (64 prompts, 128 in /
512 out) through the whole stack, `radixserve serve` with Llama-3.1-8B shapes (dummy
weights), once with both off (--no-enable-metrics, no endpoint) and once with both on
(--metrics-port on every service, every service scraped each second as a busy Prometheus
would, and --otlp-traces-endpoint exporting every span to a receiver here). Each stack runs
the workload `ROUNDS` times after a warm-up; the medians are compared."""

from __future__ import annotations

import asyncio
import signal
import statistics
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.gpu.models import llama8b_dir
from loadtest.gpu.sections import _serve
from loadtest.otlp_sink import SpanSink
from tests.conftest import free_port

ROUNDS = 3
SCRAPE_EVERY_S = 1.0
HEAVY = [
    "--dataset-name",
    "random",
    "--num-prompts",
    "64",
    "--random-input-len",
    "128",
    "--random-output-len",
    "512",
    "--random-range-ratio",
    "1.0",
]


def scrape_forever(ports: list[int], stop: threading.Event, counts: list[int]) -> None:
    while not stop.wait(SCRAPE_EVERY_S):
        for port in ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    r.read()
                    counts[0] += 1
            except OSError:
                counts[1] += 1


def run_config(model: Path, out_dir: str, name: str, on: bool) -> dict[str, Any]:
    from loadtest import serving
    from loadtest.flags import build_parser

    port = free_port()
    sink = SpanSink(free_port()).start() if on else None
    extra = ["--no-enable-metrics"]
    base_metrics = 0
    if sink is not None:
        base_metrics = free_port()
        extra = ["--metrics-port", str(base_metrics), "--otlp-traces-endpoint", sink.endpoint]
    proc = _serve(model, Path(out_dir) / f"observability_{name}.log", port, *extra)
    stop, counts = threading.Event(), [0, 0]
    scraper = None
    try:
        if on:  # the gateway's and every child's port (serve gives them from the base up)
            log = (Path(out_dir) / f"observability_{name}.log").read_text()
            line = next(x for x in log.splitlines() if x.startswith("metrics (/metrics"))
            ports = [int(p.split(":")[-1]) for p in line.split(" on ", 1)[1].split(", ")]
            scraper = threading.Thread(target=scrape_forever, args=(ports, stop, counts))
            scraper.start()
        flags = [
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--backend",
            "radixserve",
            "--tokenizer",
            str(model),
            "--disable-tqdm",
            "--seed",
            "1",
        ]

        def run(*more: str) -> Any:
            args = build_parser().parse_args([*flags, *HEAVY, *more])
            return asyncio.run(serving.benchmark(args))

        run("--num-prompts", "8")  # warm-up: CUDA graphs, allocator, caches
        runs = [run() for _ in range(ROUNDS)]
    finally:
        stop.set()
        if scraper is not None:
            scraper.join()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except Exception:
            proc.kill()
        if sink is not None:
            sink.stop()
    return {
        "output_tok_s": [m.output_throughput for m in runs],
        "median_ttft_ms": [m.ttft.median if m.ttft else None for m in runs],
        "failed": [m.failed for m in runs],
        "scrapes": counts[0],
        "scrape_errors": counts[1],
        "spans_exported": sink.spans if sink is not None else 0,
        "spans_by_name": dict(sink.by_name) if sink is not None else {},
    }


def observability_section(out_dir: str) -> dict[str, Any]:
    model = llama8b_dir(Path(tempfile.mkdtemp()), "words")
    off = run_config(model, out_dir, "off", on=False)
    on = run_config(model, out_dir, "on", on=True)
    tok_off, tok_on = (statistics.median(c["output_tok_s"]) for c in (off, on))
    ttft_off, ttft_on = (statistics.median(c["median_ttft_ms"]) for c in (off, on))
    summary = {
        "output_tok_s_off": tok_off,
        "output_tok_s_on": tok_on,
        "tok_s_ratio_on_off": tok_on / tok_off,
        "median_ttft_ms_off": ttft_off,
        "median_ttft_ms_on": ttft_on,
        "ttft_delta_ms": ttft_on - ttft_off,
        "within_targets": tok_on / tok_off >= 0.98 and ttft_on - ttft_off <= 2.0,
    }
    print(summary, flush=True)
    return {"summary": summary, "off": off, "on": on}
