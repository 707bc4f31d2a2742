"""What metrics and tracing cost on the GPU: the decode-heavy workload (64 prompts, 128 in /
512 out) through the whole stack, `radixserve serve` with Llama-3.1-8B shapes (dummy
weights). Two stacks share the GPU, each with its own KV pool: one with both off
(--no-enable-metrics, no endpoint), one with both on (--metrics-port on every service, every
service scraped each second as a busy Prometheus would, and --otlp-traces-endpoint exporting
every span to a receiver here). After a full warm-up run on each, the workload runs on them
in turn, `ROUNDS` times each, which one first alternating, so drift over the session and the
slot's own effect fall on both alike; the medians are compared, and the per-round
differences reported (a burst of 64 prompts' median TTFT varies by tens of ms run to run)."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.fault_stack import tree_cpu as process_tree_cpu
from loadtest.gpu.models import llama8b_dir
from loadtest.gpu.sections import DECODE_HEAVY, _serve
from loadtest.otlp_sink import SpanSink
from tests.conftest import free_port

ROUNDS = 6  # even: each stack runs first in half of them
KV_TOKENS = 100_000  # each stack's pool: the workload needs 64 x 640
SCRAPE_EVERY_S = 1.0
# One request at a time (128 in, 4 out): a TTFT that varies by tenths of a millisecond, where
# observability's cost on the first-token path shows if it is there at all.
ALONE = [
    "--dataset-name",
    "random",
    "--num-prompts",
    "32",
    "--max-concurrency",
    "1",
    "--random-input-len",
    "128",
    "--random-output-len",
    "4",
    "--random-range-ratio",
    "1.0",
]
ALONE_ROUNDS = 4
HEAVY = list(DECODE_HEAVY)


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of `root` and its descendants, by command line."""

    def name_of(pid: int, words: list[str]) -> str:
        return " ".join(w for w in words[3:5] if not w.startswith("-")) or "".join(words[:1])

    return process_tree_cpu(root, name_of)


def scrape_forever(ports: list[int], stop: threading.Event, counts: list[int]) -> None:
    while not stop.wait(SCRAPE_EVERY_S):
        for port in ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    r.read()
                    counts[0] += 1
            except OSError:
                counts[1] += 1


class Stack:
    """One `radixserve serve`, with metrics and tracing on or off, and its client."""

    def __init__(self, model: Path, out_dir: str, on: bool) -> None:
        self.model, self.on = model, on
        self.port = free_port()
        self.sink = SpanSink(free_port()).start() if on else None
        extra = ["--no-enable-metrics"]
        if self.sink is not None:
            extra = [
                "--metrics-port",
                str(free_port()),
                "--otlp-traces-endpoint",
                self.sink.endpoint,
            ]
        name = "on" if on else "off"
        log = Path(out_dir) / f"observability_{name}.log"
        # Each stack its own bus: sharing one, they would serve each other's requests (the
        # schedulers elect one leader and route to both executors).
        shared = os.environ.get("REDIS_URL")
        env = {"REDIS_URL": f"{shared.rsplit('/', 1)[0]}/{11 if on else 10}"} if shared else {}
        self.proc = _serve(
            model, log, self.port, "--max-total-tokens", str(KV_TOKENS), *extra, env=env
        )
        self.stop_scraping, self.counts = threading.Event(), [0, 0]
        self.scraper: threading.Thread | None = None
        if on:  # every child's port (serve gives them from the base up, and prints them)
            line = next(x for x in log.read_text().splitlines() if x.startswith("metrics (/"))
            ports = [int(p.split(":")[-1]) for p in line.split(" on ", 1)[1].split(", ")]
            self.scraper = threading.Thread(
                target=scrape_forever, args=(ports, self.stop_scraping, self.counts)
            )
            self.scraper.start()
        self.runs: list[Any] = []

    def run(self, *more: str, workload: list[str] = HEAVY) -> Any:
        from loadtest import serving
        from loadtest.flags import build_parser

        flags = [
            "--base-url",
            f"http://127.0.0.1:{self.port}",
            "--backend",
            "radixserve",
            "--tokenizer",
            str(self.model),
            "--disable-tqdm",
            "--seed",
            "1",
            *workload,
            *more,
        ]
        return asyncio.run(serving.benchmark(build_parser().parse_args(flags)))

    def close(self) -> None:
        self.stop_scraping.set()
        if self.scraper is not None:
            self.scraper.join()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        if self.sink is not None:
            self.sink.stop()

    def report(self) -> dict[str, Any]:
        return {
            "output_tok_s": [m.output_throughput for m in self.runs],
            "median_ttft_ms": [m.ttft.median if m.ttft else None for m in self.runs],
            "failed": [m.failed for m in self.runs],
            "scrapes": self.counts[0],
            "scrape_errors": self.counts[1],
            "spans_exported": self.sink.spans if self.sink is not None else 0,
            "spans_by_name": dict(self.sink.by_name) if self.sink is not None else {},
        }


def observability_section(out_dir: str) -> dict[str, Any]:
    model = llama8b_dir(Path(tempfile.mkdtemp()), "words")
    stacks: list[Stack] = []
    cpu: list[dict[str, float]] = [{}, {}]
    alone: list[list[float]] = [[], []]
    try:
        stacks.append(Stack(model, out_dir, on=False))
        stacks.append(Stack(model, out_dir, on=True))
        for s in stacks:
            s.run()  # warm-up: CUDA graphs, allocator, caches, the exporters' connections
        cpu_before = [tree_cpu(s.proc.pid) for s in stacks]
        for i in range(ROUNDS):  # off, on / on, off / ...: the slot's own effect cancels
            for s in stacks if i % 2 == 0 else stacks[::-1]:
                s.runs.append(s.run())
        cpu = [
            {k: round(v - before.get(k, 0.0), 2) for k, v in tree_cpu(s.proc.pid).items()}
            for s, before in zip(stacks, cpu_before, strict=True)
        ]
        for i in range(ALONE_ROUNDS):
            order = [0, 1] if i % 2 == 0 else [1, 0]
            for k in order:
                m = stacks[k].run(workload=ALONE)
                alone[k].append(m.ttft.median if m.ttft else float("nan"))
    finally:
        for s in stacks:
            s.close()
    off, on = (s.report() for s in stacks)
    tok_off, tok_on = (statistics.median(c["output_tok_s"]) for c in (off, on))
    ttft_off, ttft_on = (statistics.median(c["median_ttft_ms"]) for c in (off, on))
    summary = {
        "output_tok_s_off": tok_off,
        "output_tok_s_on": tok_on,
        "tok_s_ratio_on_off": tok_on / tok_off,
        "median_ttft_ms_off": ttft_off,
        "median_ttft_ms_on": ttft_on,
        "ttft_delta_ms": ttft_on - ttft_off,
        "ttft_delta_ms_by_round": [
            round(a - b, 2)
            for a, b in zip(on["median_ttft_ms"], off["median_ttft_ms"], strict=True)
        ],
        "alone_median_ttft_ms_off": alone[0],
        "alone_median_ttft_ms_on": alone[1],
        "alone_ttft_delta_ms": statistics.median(alone[1]) - statistics.median(alone[0]),
        "within_targets": tok_on / tok_off >= 0.98 and ttft_on - ttft_off <= 2.0,
    }
    print(summary, flush=True)
    off["cpu_s_during_rounds"], on["cpu_s_during_rounds"] = cpu
    print(cpu, flush=True)
    return {"summary": summary, "off": off, "on": on, "rounds": ROUNDS, "kv_tokens": KV_TOKENS}
