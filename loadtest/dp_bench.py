"""`radixserve-loadtest dp`: data parallelism measured. The generated-shared-prefix workload,
all sent at once, against a fresh `radixserve serve` per run: one executor, then --dp-size
executors under each --load-balance-method named; cache hit rate and throughput per run.

    radixserve-loadtest dp --model DIR --dp-size 2 --methods cache_aware,round_robin \
        --gsp-num-groups 8 --gsp-prompts-per-group 8 --out dp.json -- --device cpu

Flags after `--` go to every `radixserve serve`; --dp-max-total-tokens sizes each executor's
KV pool in the DP runs only (executors sharing a GPU need it: see `radixserve serve --help`).
Each serve runs its own private Redis, so nothing of one run reaches the next.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import stack_scrape
from loadtest.fault_stack import free_port

METHODS = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True)
class Run:
    name: str  # "single", or the load balance method of a DP run
    serve_args: list[str]  # beyond --model and --port


def plan(
    dp_size: int,
    methods: list[str],
    serve_args: list[str],
    dp_max_total_tokens: int = 0,
    single: bool = True,
) -> list[Run]:
    """The runs, in order: one executor first (when `single`), then one per method."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    runs = [Run("single", list(serve_args))] if single else []
    pool = ["--max-total-tokens", str(dp_max_total_tokens)] if dp_max_total_tokens else []
    for method in methods:
        dp = ["--dp-size", str(dp_size), "--load-balance-method", method]
        runs.append(Run(method, [*serve_args, *dp, *pool]))
    return runs


def serve_command(model: str, port: int, run: Run) -> list[str]:
    return [
        sys.executable,
        "-m",
        "radixserve",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        *run.serve_args,
    ]


def serving_args(base_url: str, tokenizer: str, a: argparse.Namespace) -> list[str]:
    """`loadtest.serving`'s flags for the workload."""
    return [
        "--base-url",
        base_url,
        "--backend",
        "radixserve",
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        str(a.gsp_num_groups),
        "--gsp-prompts-per-group",
        str(a.gsp_prompts_per_group),
        "--gsp-system-prompt-len",
        str(a.gsp_system_prompt_len),
        "--gsp-question-len",
        str(a.gsp_question_len),
        "--gsp-output-len",
        str(a.gsp_output_len),
        "--seed",
        str(a.seed),
        "--disable-tqdm",
    ]


def start(
    cmd: list[str], log: Path, base_url: str, executors: int, timeout: float
) -> subprocess.Popen[bytes]:
    """`cmd` (a serve) once GET /health is 200 and the scheduler routes to all `executors`
    (its log says so); its own private Redis (no REDIS_URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
                routing = f"joined: {executors} live" in log.read_text(errors="replace")
                if resp.status == 200 and routing:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"serve not ready in {timeout:.0f}s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_one(run: Run, a: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from loadtest import serving
    from loadtest.flags import build_parser

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    log = log_dir / f"serve_{run.name}.log"
    executors = 1 if run.name == "single" else a.dp_size
    # Each child serves its metrics from here on, so the run can say where the time went.
    cmd = [*serve_command(a.model, port, run), "--metrics-port", str(free_port())]
    proc = start(cmd, log, base_url, executors, a.timeout)
    ready_s = time.monotonic() - t0
    try:
        ports = stack_scrape.child_ports(log.read_text(errors="replace"))
        args = build_parser().parse_args(serving_args(base_url, a.tokenizer or a.model, a))
        series = stack_scrape.Series(ports)
        before, started, cpu = stack_scrape.scrape(ports), time.monotonic(), time.process_time()
        series.start()
        try:
            metrics = asyncio.run(serving.benchmark(args))
        finally:
            samples = series.stop()
        wall_s = time.monotonic() - started
        services = stack_scrape.usage(before, stack_scrape.scrape(ports), wall_s)
        # The benchmark client is this process: one asyncio loop parsing every stream.
        services["client"] = {"cpu_share": (time.process_time() - cpu) / wall_s}
    finally:
        stop(proc)
    head = {"run": run.name, "serve_args": run.serve_args, "ready_s": ready_s}
    lines = stack_scrape.series_table(samples)
    print(f"{run.name}, over the run:", *lines, sep="\n  ", flush=True)
    tail = {"services": services, "series": samples, "series_table": lines}
    return head | metrics.to_json() | tail


def table(results: list[dict[str, Any]]) -> str:
    head = f"{'run':<13}{'hit rate':>9}{'out tok/s':>11}{'total tok/s':>13}{'TTFT p50 ms':>13}"
    lines = [head + f"{'ok/failed':>11}", "-" * (len(head) + 11)]
    for r in results:
        hit = "n/a" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.1f}%"
        ttft = r.get("median_ttft_ms")
        lines.append(
            f"{r['run']:<13}{hit:>9}{r['output_throughput']:>11.1f}"
            f"{r['total_throughput']:>13.1f}{'-' if ttft is None else f'{ttft:.0f}':>13}"
            f"{str(r['completed']) + '/' + str(r['failed']):>11}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve-loadtest dp", description=__doc__)
    p.add_argument("--model", required=True, help="what every serve serves")
    p.add_argument("--tokenizer", help="the benchmark's tokenizer (default: --model)")
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--methods", default="cache_aware,round_robin", help="comma-separated")
    p.add_argument("--no-single", action="store_true", help="skip the one-executor run")
    p.add_argument("--dp-max-total-tokens", type=int, default=0)
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for a serve to start")
    p.add_argument("--log-dir", type=Path, default=Path("."))
    p.add_argument("--out", type=Path, help="write the runs as JSON here")
    p.add_argument("serve_args", nargs="*", help="after --: flags for every radixserve serve")
    return p


def run_all(a: argparse.Namespace, runs: list[Run] | None = None) -> list[dict[str, Any]]:
    """Each run in turn (default: as `a` plans them); with --out, the results so far are
    written after each, so a run cut short keeps what it measured."""
    if runs is None:
        methods = [m for m in a.methods.split(",") if m]
        runs = plan(a.dp_size, methods, a.serve_args, a.dp_max_total_tokens, not a.no_single)
    a.log_dir.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    results: list[dict[str, Any]] = []
    for run in runs:
        results.append(run_one(run, a, a.log_dir))
        print(table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        print("  " + stack_scrape.summary(results[-1]["services"]), file=sys.stderr, flush=True)
        if a.out is not None:
            a.out.write_text(json.dumps({"config": config, "runs": results}, indent=1) + "\n")
    return results


def main(argv: list[str]) -> None:
    a = build_parser().parse_args(argv)
    print(table(run_all(a)))
    if a.out is not None:
        print(f"wrote {a.out}", file=sys.stderr)
