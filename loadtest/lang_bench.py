"""Benchmark of radixserve.lang programs (`radixserve-loadtest lang`): the SGLang paper's
few-shot `select`, tree-of-thought `fork` and multi-turn chat workloads (lang_programs.py),
each run with run_batch on an in-process Engine with the radix cache on and then off (or on a
server, `--url`, as it is configured). Reports programs/s and the cache hit rate (cached
prompt tokens / prompt tokens, over every request the programs sent); with `--url` also the
Engine's and the HTTP API's latency for one small request, and their difference.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loadtest import lang_programs as lp
from radixserve import Engine
from radixserve.lang import EngineBackend, RuntimeEndpoint
from radixserve.lang.backends import Backend


class Counting:
    """A backend that adds up prompt and cached tokens of every result it returns."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.requests = self.prompt_tokens = self.cached_tokens = 0

    def generate(self, text: Any, sampling: dict[str, Any], **opts: Any) -> Any:
        result = self.inner.generate(text, sampling, **opts)
        with self.lock:
            for r in result if isinstance(result, list) else [result]:
                self.requests += 1
                self.prompt_tokens += r["meta_info"]["prompt_tokens"]
                self.cached_tokens += r["meta_info"]["cached_tokens"]
        return result

    def __getattr__(self, name: str) -> Any:  # generate_stream, render_chat, flush_cache, ...
        return getattr(self.inner, name)


def jobs(name: str, a: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    rng = random.Random(a.seed)
    if name == "few_shot":
        return lp.few_shot, lp.few_shot_jobs(rng, a.few_shot_programs)
    if name == "tot":
        return lp.tree_of_thought, lp.tot_jobs(rng, a.tot_programs, a.tokens)
    return lp.multi_turn, lp.multi_turn_jobs(rng, a.multi_turn_programs, a.tokens)


def run_workload(name: str, backend: Backend, a: argparse.Namespace) -> dict[str, Any]:
    program, batch = jobs(name, a)
    backend.flush_cache()  # each workload starts from a cold cache
    counting = Counting(backend)
    start = time.perf_counter()
    states = program.run_batch(batch, backend=counting, num_threads=a.num_threads, temperature=0)
    elapsed = time.perf_counter() - start
    failed = sum(s.error() is not None for s in states)
    return {
        "workload": name,
        "programs": len(states),
        "failed": failed,
        "seconds": round(elapsed, 3),
        "programs_per_s": round(len(states) / elapsed, 3),
        "requests": counting.requests,
        "prompt_tokens": counting.prompt_tokens,
        "cached_tokens": counting.cached_tokens,
        "cache_hit_rate": round(counting.cached_tokens / max(counting.prompt_tokens, 1), 4),
    }


def overhead(engine: Engine, url: str, n: int) -> dict[str, Any]:
    """One small request at a time (a short prompt, one token out), through each API."""
    http, local = RuntimeEndpoint(url), EngineBackend(engine)
    sampling = {"max_new_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {"engine": [], "http": []}
    for i in range(n + 2):  # the first two warm both paths up
        for label, backend in (("engine", local), ("http", http)):
            start = time.perf_counter()
            backend.generate(f"Request {i}: hello there", sampling)
            if i >= 2:
                times[label].append((time.perf_counter() - start) * 1000)
    e, h = statistics.median(times["engine"]), statistics.median(times["http"])
    return {
        "requests": n,
        "engine_p50_ms": round(e, 2),
        "http_p50_ms": round(h, 2),
        "http_minus_engine_ms": round(h - e, 2),
    }


def release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="radixserve-loadtest lang", description=__doc__)
    p.add_argument("--model", default="", help="HF dir or .gguf (default: bundled SmolLM2)")
    p.add_argument(
        "--llama-8b-shapes",
        action="store_true",
        help="instead of --model: Llama-3.1-8B's config with dummy weights (for GPU runs)",
    )
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=0)
    p.add_argument("--url", default="", help="also run on this server, and time Engine vs HTTP")
    p.add_argument("--workloads", default="few_shot,tot,multi_turn")
    p.add_argument("--few-shot-programs", type=int, default=64)
    p.add_argument("--tot-programs", type=int, default=4)
    p.add_argument("--multi-turn-programs", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16, help="tokens per generated thought/answer")
    p.add_argument("--num-threads", type=int, default=64)
    p.add_argument("--overhead-requests", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/lang.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    names = [w for w in a.workloads.split(",") if w]
    unknown = set(names) - {"few_shot", "tot", "multi_turn"}
    if unknown:
        raise SystemExit(f"unknown workload(s) {sorted(unknown)}: few_shot, tot, multi_turn")
    report: dict[str, Any] = {"args": vars(a), "runs": []}
    model, load_format = a.model or None, a.load_format
    if a.llama_8b_shapes:
        from loadtest.gpu.models import llama8b_dir

        model, load_format = str(llama8b_dir(Path(tempfile.mkdtemp()))), "dummy"
    for cache in ("on", "off"):
        with Engine(
            model,
            show_progress=False,
            device=a.device,
            dtype=a.dtype,
            load_format=load_format,
            mem_fraction_static=a.mem_fraction_static,
            max_total_tokens=a.max_total_tokens,
            disable_radix_cache=cache == "off",
        ) as engine:
            for name in names:
                row = {
                    "through": "engine",
                    "cache": cache,
                    **run_workload(name, EngineBackend(engine), a),
                }
                print(json.dumps(row), flush=True)
                report["runs"].append(row)
            if a.url and cache == "on":
                report["overhead"] = overhead(engine, a.url, a.overhead_requests)
                print(json.dumps({"overhead": report["overhead"]}), flush=True)
        # The next engine sizes its KV pool from the free GPU memory: this one's must be gone.
        del engine
        release_device_memory()
    if a.url:
        for name in names:
            row = {
                "through": "http",
                "cache": "server's",
                **run_workload(name, RuntimeEndpoint(a.url), a),
            }
            print(json.dumps(row), flush=True)
            report["runs"].append(row)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    return report
