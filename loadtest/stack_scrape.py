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
        for phase in ("decode", "extend"):
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


def gauges(text: str) -> dict[str, float]:
    """An executor's running and queued requests, from one /metrics page."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in GAUGES:
                out[GAUGES[s.name]] = s.value
    return out


class Series(threading.Thread):
    """Every executor's running and queued requests, sampled every `period_s` until stopped:
    when each filled up, and how long each ran short of work, across a run."""

    def __init__(self, ports: dict[str, int], period_s: float = 0.5) -> None:
        super().__init__(name="stack-series", daemon=True)
        self.ports = {n: p for n, p in ports.items() if n.startswith("executor")}
        self.period_s = period_s
        self.samples: list[dict[str, Any]] = []
        self._stop_event = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        while not self._stop_event.is_set():
            row: dict[str, Any] = {"t": round(time.monotonic() - self._t0, 3)}
            for name, port in self.ports.items():
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                        row[name] = gauges(r.read().decode())
                except OSError:
                    continue
            self.samples.append(row)
            self._stop_event.wait(self.period_s)

    def stop(self) -> list[dict[str, Any]]:
        self._stop_event.set()
        self.join(timeout=10)
        return self.samples
