"""Where a `radixserve serve` spends itself during a benchmark: each child's /metrics (on the
ports `--metrics-port` gives them) read before and after, so a run can say which service ran
out of CPU and how busy each executor was.

- every service: CPU seconds over the run's wall time (`process_cpu_seconds_total`, the
  prometheus_client process collector every service registers). A single-threaded asyncio
  service at 1.0 is saturated.
- executors: decode and extend steps taken, their mean host time (the step loop's own
  `radixserve:executor_step_seconds` histogram) and the share of the run spent stepping.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_PORTS_LINE = re.compile(r"^metrics \(/metrics, /health\) on (.+)$", re.MULTILINE)
STEP_METRIC = "radixserve:executor_step_seconds"


def child_ports(serve_log: str) -> dict[str, int]:
    """{child name: metrics port}, from the line `radixserve serve` prints at start."""
    m = _PORTS_LINE.search(serve_log)
    if m is None:
        return {}
    ports: dict[str, int] = {}
    for item in m.group(1).split(", "):
        name, _, port = item.rpartition(" :")
        ports[name] = int(port)
    return ports


def sample(text: str) -> dict[str, float]:
    """The figures this module compares, from one /metrics page."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "process_cpu_seconds_total":
                out["cpu_s"] = s.value
            elif s.name in (f"{STEP_METRIC}_sum", f"{STEP_METRIC}_count"):
                kind = "sum" if s.name.endswith("_sum") else "count"
                key = f"{s.labels.get('phase', '')}_{kind}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def scrape(ports: dict[str, int], host: str = "127.0.0.1") -> dict[str, dict[str, float]]:
    """One sample per child; a child that does not answer is left out."""
    out: dict[str, dict[str, float]] = {}
    for name, port in ports.items():
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
                out[name] = sample(r.read().decode())
        except OSError:
            continue
    return out


def usage(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], wall_s: float
) -> dict[str, dict[str, Any]]:
    """Per child over the run: CPU share of one core, and for executors the steps."""
    report: dict[str, dict[str, Any]] = {}
    for name, end in after.items():
        start = before.get(name, {})

        def delta(key: str, end: dict[str, float] = end, start: dict[str, float] = start) -> float:
            return end.get(key, 0.0) - start.get(key, 0.0)

        row: dict[str, Any] = {"cpu_share": delta("cpu_s") / wall_s if wall_s > 0 else None}
        # the executor's phases (services/executor/engine/stats.PHASES)
        for phase in ("decode", "extend", "extend_rows"):
            n, total = delta(f"{phase}_count"), delta(f"{phase}_sum")
            if n:
                row[f"{phase}_steps"] = int(n)
                row[f"{phase}_step_ms"] = 1000 * total / n
                row[f"{phase}_busy_share"] = total / wall_s if wall_s > 0 else None
        report[name] = row
    return report


def summary(services: dict[str, dict[str, Any]]) -> str:
    """One line: each executor's decode step time and busy share, then every child's CPU."""
    parts = []
    for name, row in sorted(services.items()):
        if "decode_steps" in row:
            parts.append(
                f"{name} decode {row['decode_step_ms']:.1f} ms x {row['decode_steps']} "
                f"(busy {100 * (row['decode_busy_share'] or 0):.0f}%)"
            )
    cpu = [
        f"{name} {row['cpu_share']:.2f}"
        for name, row in sorted(services.items(), key=lambda kv: -(kv[1]["cpu_share"] or 0))
        if row["cpu_share"] is not None
    ]
    return "; ".join(parts + (["cpu (cores): " + ", ".join(cpu)] if cpu else []))


GAUGES = {"sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "queued"}
GENERATED = "radixserve:executor_generated_tokens"
PENDING = "radixserve:stream_pending"


def series_sample(text: str) -> dict[str, Any]:
    """One child's figures for the series: CPU seconds, its input streams' unread or
    unacknowledged entries, and for an executor its running and queued requests, tokens
    generated and seconds spent stepping (both cumulative)."""
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in GAUGES:
                out[GAUGES[s.name]] = s.value
            elif s.name == "process_cpu_seconds_total":
                out["cpu_s"] = s.value
            elif s.name in (GENERATED, f"{GENERATED}_total"):
                out["generated"] = out.get("generated", 0.0) + s.value
            elif s.name == f"{STEP_METRIC}_sum":
                out["busy_s"] = out.get("busy_s", 0.0) + s.value
            elif s.name == PENDING and s.value:
                out.setdefault("pending", {})[s.labels.get("stream", "?")] = s.value
    return out


class Series(threading.Thread):
    """Every child's /metrics sampled every `period_s` until stopped (`series_sample`), and
    this process's CPU seconds as "client": when each executor filled up or ran short of
    work, which service's CPU or input backlog grew, across a run."""

    def __init__(self, ports: dict[str, int], period_s: float = 0.5) -> None:
        super().__init__(name="stack-series", daemon=True)
        self.ports = ports
        self.period_s = period_s
        self.samples: list[dict[str, Any]] = []
        self._stop_event = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        while not self._stop_event.is_set():
            row: dict[str, Any] = {"t": round(time.monotonic() - self._t0, 3)}
            row["client"] = {"cpu_s": time.process_time()}
            for name, port in self.ports.items():
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                        row[name] = series_sample(r.read().decode())
                except OSError:
                    continue
            self.samples.append(row)
            self._stop_event.wait(self.period_s)

    def stop(self) -> list[dict[str, Any]]:
        self._stop_event.set()
        self.join(timeout=10)
        return self.samples


def _rate(now: dict[str, Any], then: dict[str, Any], key: str, dt: float) -> float:
    return (now.get(key, 0.0) - then.get(key, 0.0)) / dt if dt > 0 else 0.0


def series_table(samples: list[dict[str, Any]], every_s: float = 2.0) -> list[str]:
    """The series as lines of text, one per `every_s` of the run: per executor its running
    and queued requests, share of the interval spent stepping and tokens per second; every
    other child's CPU share over the interval and its largest input backlog."""
    lines: list[str] = []
    last: dict[str, Any] | None = None
    for row in samples:
        if last is not None and row["t"] - last["t"] < every_s:
            continue
        if last is None:
            last = row
            continue
        dt = row["t"] - last["t"]
        parts = [f"t={row['t']:6.1f}"]
        for name in sorted(k for k in row if k != "t"):
            now, then = row[name], last.get(name, {})
            if "running" in now:
                parts.append(
                    f"{name} run {now['running']:.0f} q {now.get('queued', 0):.0f} "
                    f"busy {_rate(now, then, 'busy_s', dt):.2f} "
                    f"{_rate(now, then, 'generated', dt):.0f} tok/s"
                )
            else:
                backlog = max(now.get("pending", {}).values(), default=0)
                cpu = f"{name} cpu {_rate(now, then, 'cpu_s', dt):.2f}"
                parts.append(cpu + (f" backlog {backlog:.0f}" if backlog else ""))
        lines.append(" | ".join(parts))
        last = row
    return lines
