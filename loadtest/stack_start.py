"""How long `radixserve serve` takes to start, and to bring back a killed service, with the
services forked by the zygote (`--preload`, the default) and started from their commands
(`--no-preload`): seconds to ready, CPU seconds of the whole process tree at ready, and for
each service killed with SIGKILL, the seconds until /health is 200 again.

    python -m loadtest.stack_start --model DIR --runs 2 --out loadtest/results/stack_start.json

The modes alternate run by run, so a machine whose speed drifts affects both alike, and one
unmeasured start comes first (`--warmup`): a fresh machine's first start converts the
tokenizer and compiles the Triton kernels into their caches, which every later start reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.fault_stack import RedisServer, Stack, service_of, tree_cpu, wait_for

KILLED = ("tokenizer", "grammar", "detokenizer", "scheduler", "executor")


def tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds of `root` and its live descendants, by service ("serve", "zygote",
    "other" for the rest)."""

    def name_of(pid: int, words: list[str]) -> str:
        if pid == root:
            return "serve"
        return service_of(words) or ("zygote" if "radixserve.zygote" in words else "other")

    return {k: round(v, 2) for k, v in tree_cpu(root, name_of).items()}


def restart_s(stack: Stack, service: str, timeout: float) -> float:
    """SIGKILL one `service`; the seconds until /health turned 503 and then 200 again."""
    killed_at = time.monotonic()
    stack.kill(service)
    wait_for(lambda: not stack.healthy(), 10, f"/health 503 without the {service}", 0.02)
    wait_for(stack.healthy, timeout, f"/health 200 with a new {service}", 0.02)
    return round(time.monotonic() - killed_at, 2)


def one_run(
    args: list[str], preload: bool, log_dir: Path, timeout: float, killed: list[str]
) -> dict[str, Any]:
    redis = RedisServer()
    redis.start()
    stack = Stack(redis, [*args, "--preload" if preload else "--no-preload"], log_dir)
    try:
        ready = stack.start(timeout)
        assert stack.proc is not None
        row: dict[str, Any] = {"preload": preload, "ready_s": round(ready, 2)}
        row["cpu_at_ready_s"] = tree_cpu_s(stack.proc.pid)
        row["cpu_at_ready_total_s"] = round(sum(row["cpu_at_ready_s"].values()), 2)
        row["restart_s"] = {s: restart_s(stack, s, timeout) for s in killed}
        return row
    finally:
        stack.stop()
        redis.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m loadtest.stack_start", description=__doc__)
    p.add_argument("--model", default="", help="serve's --model (default: the default model)")
    p.add_argument("--device", default="cpu", help="serve's --device")
    p.add_argument("--runs", type=int, default=2, help="runs of each mode")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured starts first")
    p.add_argument("--kill", default=",".join(KILLED), help="services to kill, one after the other")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, help="write the record (JSON) here")
    p.add_argument("serve_args", nargs="*", help="more flags for serve (after --)")
    a = p.parse_args(argv)
    args = [*(["--model", a.model] if a.model else []), "--device", a.device, *a.serve_args]
    killed = [s for s in a.kill.split(",") if s]
    rows = []
    with tempfile.TemporaryDirectory(prefix="stack-start-") as tmp:
        for i in range(a.warmup):
            one_run(args, False, Path(tmp) / f"warmup{i}", a.timeout, [])
        for i in range(a.runs):
            for preload in (True, False) if i % 2 == 0 else (False, True):
                log_dir = Path(tmp) / f"run{i}-{preload}"
                row = one_run(args, preload, log_dir, a.timeout, killed)
                print(json.dumps(row), flush=True)
                rows.append(row)
    record = {
        "command": "python -m loadtest.stack_start " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "runs": rows,
    }
    if a.out:
        a.out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
