"""The `burst` section: the whole stack under a burst and under a cached-prefix load, on the GPU.

`radixserve serve` runs Llama-3.1-8B's shapes with dummy weights (the word tokenizer, so every
sampled id decodes). Three runs, each asking whether any request was lost:

- 2,000 requests sent at once, no retries: every answer is 2xx, or a deliberate 429/503 that
  carries Retry-After; nothing hangs, nothing fails otherwise.
- the same burst with the client honouring Retry-After: all 2,000 complete.
- the generated-shared-prefix workload at concurrency 256: every request completes.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
from pathlib import Path
from typing import Any

from loadtest.gpu.models import llama8b_dir
from loadtest.gpu.sections import _serve

BURST_N = 2000


def _burst(port: int, retry: bool) -> dict[str, Any]:
    from loadtest import burst

    p = argparse.ArgumentParser()
    burst.add_arguments(p)
    argv = ["--base-url", f"http://127.0.0.1:{port}", "--n", str(BURST_N), "--max-tokens", "64"]
    argv += ["--hang-timeout", "240"] + (["--retry"] if retry else [])
    summary = asyncio.run(burst.burst(p.parse_args(argv)))
    print(burst.table(summary), flush=True)
    counts = summary["counts"]
    refused = summary["refusals"]
    summary["lost"] = BURST_N - counts.get("2xx", 0) - (0 if retry else refused)
    summary["refusals_without_retry_after"] = refused - summary["refusals_with_retry_after"]
    return summary


def _shared_prefix(port: int, model: Path) -> dict[str, Any]:
    from loadtest import serving
    from loadtest.flags import build_parser

    args = build_parser().parse_args(
        [
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--backend",
            "radixserve",
            "--tokenizer",
            str(model),
            "--disable-tqdm",
            "--seed",
            "1",
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            "32",
            "--gsp-prompts-per-group",
            "16",
            "--gsp-system-prompt-len",
            "2048",
            "--gsp-question-len",
            "128",
            "--gsp-output-len",
            "256",
            "--max-concurrency",
            "256",
        ]
    )
    m = asyncio.run(serving.benchmark(args))
    out = m.to_json()
    requests = 32 * 16
    out["requests"] = requests
    out["lost"] = requests - m.completed
    print(
        f"shared prefix at 256: {m.completed}/{requests} completed, {m.failed} failed, "
        f"cache hit rate {m.cache_hit_rate}, {m.output_throughput:.0f} output tok/s",
        flush=True,
    )
    return out


def burst_section(log_dir: str) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root, tokenizer="words")
    port = 18100
    proc = _serve(model, Path(log_dir) / "serve_burst.log", port)
    try:
        return {
            "burst_2000": _burst(port, retry=False),
            "burst_2000_retry": _burst(port, retry=True),
            "shared_prefix_256": _shared_prefix(port, model),
        }
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except Exception:
            proc.kill()
