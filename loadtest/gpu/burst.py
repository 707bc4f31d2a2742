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
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtest.gpu.models import llama8b_dir
from loadtest.gpu.sections import _serve, stop_serve

BURST_N = 2000


def burst_2000(port: int, retry: bool) -> dict[str, Any]:
    """BURST_N requests at once to the server on `port` (with `retry`, each 429/503 sent again
    after its Retry-After): the burst's summary plus "lost" and the refusals without a hint."""
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


def _shared_prefix(
    port: int, model: Path, groups: int = 32, concurrency: int | None = 256
) -> dict[str, Any]:
    """The generated-shared-prefix workload: `groups` system prompts of 2,048 tokens, 16
    questions of 128 each, 256 output tokens."""
    from loadtest import serving
    from loadtest.flags import build_parser

    argv = ["--base-url", f"http://127.0.0.1:{port}", "--backend", "radixserve"]
    argv += ["--tokenizer", str(model), "--disable-tqdm", "--seed", "1"]
    argv += ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups)]
    argv += ["--gsp-prompts-per-group", "16", "--gsp-system-prompt-len", "2048"]
    argv += ["--gsp-question-len", "128", "--gsp-output-len", "256"]
    if concurrency is not None:
        argv += ["--max-concurrency", str(concurrency)]
    m = asyncio.run(serving.benchmark(build_parser().parse_args(argv)))
    out = m.to_json()
    requests = groups * 16
    out["requests"] = requests
    out["lost"] = requests - m.completed
    print(
        f"shared prefix at 256: {m.completed}/{requests} completed, {m.failed} failed, "
        f"cache hit rate {m.cache_hit_rate}, {m.output_throughput:.0f} output tok/s",
        flush=True,
    )
    return out


@contextmanager
def serving_words(
    log: Path, port: int, *flags: str, config: dict[str, Any] | None = None
) -> Iterator[Path]:
    """`radixserve serve` (and `flags`) on Llama-3.1-8B's shapes with dummy weights and the
    word tokenizer, for the with-block; yields the model's directory. config: entries added
    to its config.json (a quantization_config, say)."""
    model = llama8b_dir(Path(tempfile.mkdtemp()), tokenizer="words")
    if config:
        path = model / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}, indent=1))
    proc = _serve(model, log, port, *flags)
    try:
        yield model
    finally:
        stop_serve(proc)


def burst_section(log_dir: str) -> dict[str, Any]:
    port = 18100
    with serving_words(Path(log_dir) / "serve_burst.log", port) as model:
        return {
            "burst_2000": burst_2000(port, retry=False),
            "burst_2000_retry": burst_2000(port, retry=True),
            "shared_prefix_256": _shared_prefix(port, model),
        }


def shared_prefix_section(log_dir: str) -> dict[str, Any]:
    """Issue 26's check: the generated-shared-prefix workload at SGLang's defaults (64 groups
    of 16, every request sent at once) through `radixserve serve`, with the radix cache and
    with `--disable-radix-cache`, and the ratio of their output throughputs."""
    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root, tokenizer="words")
    out: dict[str, Any] = {}
    for name, extra in (("cache_on", ()), ("cache_off", ("--disable-radix-cache",))):
        port = 18110 if name == "cache_on" else 18111
        proc = _serve(model, Path(log_dir) / f"serve_gsp_{name}.log", port, *extra)
        try:
            out[name] = _shared_prefix(port, model, groups=64, concurrency=None)
        finally:
            stop_serve(proc)
    on, off = out["cache_on"]["output_throughput"], out["cache_off"]["output_throughput"]
    out["speedup"] = on / off if off else None
    print(f"shared prefix: {on:.0f} vs {off:.0f} output tok/s, {out['speedup']:.2f}x", flush=True)
    return out
