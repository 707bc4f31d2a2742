"""The device's timeline over steady-state decode steps: how much of each step's wall time
the GPU is busy, where it sits idle, and which kernels take the time.

Host phase timings (hosttime.py) say how long the host waits; only the device's own trace
says whether it idles between kernels, and after which ones. The profiler records CUDA
activity only (recording host ops too would slow the host it is judging).
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from loadtest.gpu.hosttime import HostTimes
from services.executor.engine.loop import Engine
from shared.messages.common import AbortRequest
from shared.messages.schedule import TokenizedRequest

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_REPORTED_US = 20.0  # idle stretches shorter than this are launch jitter, not a cause


def device_intervals(trace: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel, copy and memset of a Chrome trace."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES:
            out.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]))
    out.sort()
    return out


def summarize(
    intervals: list[tuple[float, float, str]], steps: int, top_kernels: int = 12
) -> dict[str, Any]:
    """Busy and idle device time per step over the traced window, the longest idle
    stretches with the activity on either side, and the kernels that take the most time."""
    if not intervals:
        return {"steps": steps, "error": "no device activity recorded"}
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []
    cur_start, cur_end, cur_name = intervals[0]
    per_kernel: dict[str, float] = defaultdict(float)
    for start, end, name in intervals:
        per_kernel[name[:80]] += end - start
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end >= GAP_REPORTED_US:
                gaps.append((start - cur_end, cur_name[:60], name[:60]))
            cur_start = start
        if end > cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    window = intervals[-1][1] - intervals[0][0]
    idle = sum(g for g, _, _ in gaps)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top_kernels]
    gaps.sort(reverse=True)
    return {
        "steps": steps,
        "window_ms_per_step": window / steps / 1000,
        "busy_ms_per_step": busy / steps / 1000,
        "busy_share": busy / window,
        f"idle_ms_per_step_in_gaps_over_{GAP_REPORTED_US:g}us": idle / steps / 1000,
        "gaps_per_step": len(gaps) / steps,
        "device_ops_per_step": len(intervals) / steps,
        "longest_gaps_us": [(round(g, 1), before, after) for g, before, after in gaps[:8]],
        "top_kernels_us_per_step": [(round(us / steps, 1), name) for name, us in top],
    }


def start_decoding(engine: Engine, reqs: list[TokenizedRequest], warm: int) -> None:
    """Submit `reqs` and step until every prompt is computed, then `warm` decode steps more;
    the device is idle on return."""
    for r in reqs:
        engine.submit(r)
    engine.step()  # moves the submissions from the inbox to the queue
    while engine.policy.waiting or engine.policy.prefilling:
        engine.step()
    for _ in range(warm):
        engine.step()
    torch.cuda.synchronize()


def abort_all(engine: Engine) -> None:
    """Abort every request in the engine and step until it is empty."""
    for rid in [r.rid for r in engine.requests()]:
        engine.submit(AbortRequest(rid=rid, reason="measured"))
    while engine.has_work():
        engine.step()


def profile_decode(
    engine: Engine,
    reqs: list[TokenizedRequest],
    warm: int,
    steps: int,
    host: HostTimes | None = None,
    top_kernels: int = 12,
) -> dict[str, Any]:
    """Submit `reqs`, run until every prompt is computed plus `warm` decode steps, trace the
    next `steps` steps, then abort what is left. The requests must decode past that.
    `host`: the engine's phase timers, to break the slowest steps down by phase."""
    from torch.profiler import ProfilerActivity, profile

    start_decoding(engine, reqs, warm)
    per_step: list[tuple[float, dict[str, float]]] = []
    with GcPauses() as gc_pauses, profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            before = dict(host.seconds) if host is not None else {}
            t = time.perf_counter()
            engine.step()
            phases = {k: v - before.get(k, 0.0) for k, v in host.seconds.items()} if host else {}
            per_step.append((time.perf_counter() - t, phases))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    abort_all(engine)
    out = summarize(device_intervals(trace), steps, top_kernels)
    out["wall_ms_per_step_profiled"] = 1000 * wall / steps
    walls = sorted(w for w, _ in per_step)
    out["host_step_ms_median"] = 1000 * walls[len(walls) // 2]
    out["slowest_steps_ms"] = [
        {"step_ms": round(1000 * w, 3), **{k: round(1000 * v, 3) for k, v in sorted(ph.items())}}
        for w, ph in sorted(per_step, key=lambda x: -x[0])[:5]
    ]
    out["gc"] = gc_pauses.report()
    return out


class GcPauses:
    """Python garbage collections inside a `with` block: count, total and longest pause
    per generation (a collection stops the host, and a stopped host starves the device)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def report(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for gen, pause in self.pauses:
            r = out.setdefault(f"gen{gen}", {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
            r["count"] += 1
            r["total_ms"] += 1000 * pause
            r["max_ms"] = max(r["max_ms"], 1000 * pause)
        return out
