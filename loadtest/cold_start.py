"""How long an in-process `Engine` takes to start on a GPU where nothing is compiled or saved
yet, phase by phase, and again with the caches that first start filled.

    python -m loadtest.cold_start --kinds bf16,awq,fp8 --out loadtest/results/cold_start.json
    python -m loadtest.cold_start --model DIR --kinds bf16 --out ...

The kinds are a tiny random Llama (tests/executor/helpers.py) in bf16, the same weights as an
AWQ checkpoint (group 32, the project's own quantizer), and in bf16 quantized to fp8 at load
(`quantization="fp8"`); `--model` starts that model instead (bf16 and fp8 only). Each start
is a process of its own; a kind's first start gets an empty TRITON_CACHE_DIR and
RADIXSERVE_CACHE_DIR (tokenizers, gemv choices), its second the same two as the first left
them. The phases (weights, kv pool, kernel timing, cuda graphs, warm-up) are timed from the
load progress lines a start writes to stderr, as they arrive. A start ends with an 8-token greedy
generation, whose text the row keeps: a start that computes wrongly is seen, not only timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"


def tiny_models(root: Path) -> dict[str, tuple[Path, dict[str, str]]]:
    """The kinds' model directories and their Engine flags."""
    from safetensors.torch import load_file, save_file

    from services.executor.quant.int4_quantize import quantize_checkpoint
    from tests.executor.helpers import write_tiny_model

    src = write_tiny_model(root / "bf16", "llama", 3)
    awq = root / "awq"
    tensors, qc, _ = quantize_checkpoint(
        load_file(src / "model.safetensors"), method="awq", group_size=32
    )
    shutil.copytree(src, awq, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, awq / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (awq / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return {"bf16": (src, {}), "awq": (awq, {}), "fp8": (src, {"quantization": "fp8"})}


def phases(lines: list[tuple[float, str]], started: float, ready: float) -> dict[str, float]:
    """Seconds from each progress phase's first line to the next phase's (the last one's to
    `ready`), from (arrival time, line) pairs; "before" is the time to the first line."""
    firsts: list[tuple[str, float]] = []
    for at, line in lines:
        if not line.startswith("loading "):
            continue
        phase = line.rsplit("%", 1)[-1].strip()
        if not firsts or firsts[-1][0] != phase:
            firsts.append((phase, at))
    out = {"before": round((firsts[0][1] if firsts else ready) - started, 2)}
    ends = [at for _, at in firsts[1:]] + [ready] * bool(firsts)
    for (phase, at), nxt in zip(firsts, ends, strict=True):
        out[phase] = round(out.get(phase, 0.0) + nxt - at, 2)
    return out


def one_start(
    model: Path, flags: dict[str, str], device: str, cache: Path, timeout: float
) -> dict[str, Any]:
    """One start in a child process on the caches under `cache` (Triton's, radixserve's): its
    phases, seconds to ready and greedy text."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.update(TRITON_CACHE_DIR=str(cache / "triton"), RADIXSERVE_CACHE_DIR=str(cache / "rs"))
    cmd = [sys.executable, "-m", "loadtest.cold_start", "--child", str(model), "--device", device]
    cmd += [f"--flag={k}={v}" for k, v in flags.items()]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and proc.stdout is not None
    watchdog = threading.Timer(timeout, proc.kill)  # a hung start ends the stderr it blocks on
    watchdog.start()
    lines: list[tuple[float, str]] = []
    try:
        for line in proc.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if line.startswith("ready "):
                break
        ready = time.monotonic()
        out, _ = proc.communicate()
    finally:
        watchdog.cancel()
    if proc.returncode != 0 or not out.strip():
        tail = "\n".join(line for _, line in lines[-20:])
        raise RuntimeError(f"the start of {model} failed ({proc.returncode}):\n{tail}")
    return {
        "ready_s": round(ready - started, 2),
        **phases(lines, started, ready),
        **json.loads(out),
    }


def child(model: str, device: str, flags: list[str]) -> None:
    """One start (the parent times it from stderr), then the greedy text on stdout."""
    from radixserve import Engine

    kwargs = dict(flag.split("=", 1) for flag in flags)
    engine = Engine(model, device=device, show_progress=True, **kwargs)
    print("ready ", file=sys.stderr, flush=True)
    result = engine.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
    engine.shutdown()
    print(json.dumps({"text": result["text"]}), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(prog="python -m loadtest.cold_start")
    p.add_argument("--kinds", default="bf16,awq,fp8")
    p.add_argument("--model", help="a model directory instead of the tiny models")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    p.add_argument("--out", help="the results file (JSON)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--flag", action="append", default=[], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child, a.device, a.flag)
        return None
    if not a.out:
        p.error("--out is required")
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:  # models and caches
        root = Path(tmp)
        if a.model:
            model = Path(a.model)
            models = {"bf16": (model, {}), "fp8": (model, {"quantization": "fp8"})}
        else:
            models = tiny_models(root)
        for kind in a.kinds.split(","):
            model, flags = models[kind]
            cache = root / f"caches-{kind}"
            rows[kind] = {
                start: one_start(model, flags, a.device, cache, a.timeout)
                for start in ("cold", "warm")
            }
            print(kind, json.dumps(rows[kind]), flush=True)
    import torch

    result = {
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "model": a.model or "tiny llama (tests/executor/helpers.py, seed 3)",
        "starts": rows,
    }
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
