"""Offline engine benchmark: the executor in-process, no bus, no HTTP.

    python -m loadtest.offline throughput --model DIR --num-prompts 500 \
        --input-len 4096 --output-len 2048 --range-ratio 0.0 [--load-format dummy]
    python -m loadtest.offline latency --model DIR --batch-size 32 --input-len 512 \
        --output-len 256 [--load-format dummy]

`throughput` sends every request at once (lengths uniform in [L*r, L], ignore_eos) and reports
output and total tokens per second. `latency` runs one static batch as serving runs it: after a
warm-up batch of the same shapes (so no kernel compiles and no CUDA graph is captured on the
clock), every request is submitted at once and the engine steps with its overlapped loop, no
sync between steps; prefill is the time until the last request's first token reached the host
(the batch's time to first token), decode the rest. With `--load-format dummy` the model directory
needs only a config.json: weights are random at the config's shapes, so big models need no
weights file. Results are appended as JSON lines to --output-file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loadtest.offline_prompts import random_ids, throughput_prompts
from services.executor import flags
from services.executor.builder import KV_CACHE_DTYPES, EngineSettings, build_engine
from services.executor.engine.loop import Engine
from services.executor.grammar.backend import GrammarBackend
from services.executor.quant.registry import QUANTIZATION_CHOICES
from shared.messages.common import AbortRequest, SamplingParams, Trace
from shared.messages.detok import StepOutput
from shared.messages.schedule import TokenizedRequest
from shared.model_files import resolve_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.offline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("mode", choices=["throughput", "latency"])
    p.add_argument("--model", default="", help="HF dir or .gguf (default: bundled SmolLM2)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    p.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_CHOICES),
        help="weights: the checkpoint's format, or fp8 (a float checkpoint quantized at load)",
    )
    p.add_argument(
        "--attention-backend",
        # the executor's variable: gpu_bench's sections run on FlashInfer with it set
        default=os.environ.get("RADIXSERVE_ATTENTION_BACKEND", "auto"),
        choices=["auto", "torch", "triton", "flashinfer"],
    )
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=flags.CUDA_GRAPH_MAX_BS)
    p.add_argument("--max-total-tokens", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float, default=flags.MEM_FRACTION_STATIC)
    p.add_argument("--max-running-requests", type=int, default=flags.MAX_RUNNING_REQUESTS)
    p.add_argument("--max-prefill-tokens", type=int, default=flags.MAX_PREFILL_TOKENS)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--num-prompts", type=int, default=100, help="throughput: requests")
    p.add_argument("--batch-size", type=int, default=8, help="latency: the static batch")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=1.0,
        help="throughput: lengths uniform in [len*ratio, len]",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="throughput: stop after this many seconds and report what got done",
    )
    p.add_argument("--output-file", default="results/offline.jsonl")
    p.add_argument(
        "--through",
        default="internal",
        choices=["internal", "engine"],
        help="throughput: step the executor's engine directly, or go through the public "
        "radixserve.Engine (validation, tokenizer and detokenizer cores, its own thread)",
    )
    return p.parse_args(argv)


def make_engine(a: argparse.Namespace, grammars: GrammarBackend | None = None) -> Engine:
    settings = EngineSettings(
        model=resolve_model(a.model),
        name="offline",
        stream="offline",
        device=a.device,
        dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype,
        quantization=a.quantization,
        load_format=a.load_format,
        max_total_tokens=a.max_total_tokens,
        mem_fraction_static=a.mem_fraction_static,
        max_running_requests=a.max_running_requests,
        max_prefill_tokens=a.max_prefill_tokens,
        attention_backend=a.attention_backend,
        disable_radix_cache=a.disable_radix_cache,
        disable_cuda_graph=a.disable_cuda_graph,
        cuda_graph_max_bs=a.cuda_graph_max_bs,
    )
    return build_engine(settings, grammars=grammars)


def request(rid: str, ids: list[int], out_len: int) -> TokenizedRequest:
    return TokenizedRequest(
        trace=Trace(rid=rid, reply_to="", deadline=time.time() + 86400),
        input_ids=ids,
        sampling=SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True),
        max_new_tokens=out_len,
        eos_token_ids=[],
        detok_stream="offline",
    )


def sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def run_throughput(engine: Engine, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    vocab = engine.runner.vocab_size
    reqs = [
        request(f"r{i}", ids, n) for i, (ids, n) in enumerate(throughput_prompts(rng, a, vocab))
    ]
    drain(engine, [request("warmup", [11] * 16, 4)])
    sync(engine)
    start = time.perf_counter()
    d = drain(engine, reqs, time_limit=a.time_limit)
    sync(engine)
    elapsed = time.perf_counter() - start
    in_tokens = sum(len(r.input_ids) for r in reqs)
    ttft = [t - start for t in d.first_token_at.values()]
    return {
        "requests": len(reqs),
        "finished": d.finished,
        "input_tokens": in_tokens,
        "output_tokens": d.tokens,
        "elapsed_s": elapsed,
        "steps": d.steps,
        "output_tok_s": d.tokens / elapsed,
        "total_tok_s": (in_tokens + d.tokens) / elapsed,
        "request_s": d.finished / elapsed,
        "ttft_ms_median": 1000 * statistics.median(ttft) if ttft else float("nan"),
        "ttft_ms_mean": 1000 * statistics.fmean(ttft) if ttft else float("nan"),
        "stopped_at_time_limit": d.stopped,
        # Where the time went: each step's wall time is charged to its kind (with overlap a
        # step's time is mostly the device finishing the previous one).
        "extend_steps": d.extend_steps,
        "decode_steps": d.decode_steps,
        "extend_s": d.extend_s,
        "decode_s": d.decode_s,
        "steady_decode_steps": d.steady_decode_steps,
        "steady_decode_s": d.steady_decode_s,
        "extend_tokens": d.extend_tokens,  # more than the input when retraction recomputes
        "decode_batch_mean": d.decode_bs_sum / d.decode_steps if d.decode_steps else 0.0,
        "overlapped_steps": engine.overlapped_steps,
        "retractions": engine.policy.num_retracted,
    }


@dataclass
class Drained:
    tokens: int = 0
    steps: int = 0
    finished: int = 0
    stopped: bool = False  # the time limit ended the run; the counts are what got done
    extend_steps: int = 0
    decode_steps: int = 0
    extend_s: float = 0.0
    decode_s: float = 0.0
    extend_tokens: int = 0
    decode_bs_sum: int = 0
    # decode steps that follow a decode step: with overlap, a decode step right after an
    # extend spends its time waiting for that prefill chunk on the device, so only these
    # measure decoding itself (issue 26's table)
    steady_decode_steps: int = 0
    steady_decode_s: float = 0.0
    decode_step_ends: list[float] = field(default_factory=list)
    first_token_at: dict[str, float] = field(default_factory=dict)
    tokens_by_rid: dict[str, int] = field(default_factory=dict)


def drain(engine: Engine, reqs: list[TokenizedRequest], time_limit: float = 0.0) -> Drained:
    """Submit all, step until done (or for `time_limit` seconds, then abort the rest)."""
    for r in reqs:
        engine.submit(r)
    out = Drained()
    deadline = time.perf_counter() + time_limit if time_limit > 0 else float("inf")
    last_was_decode = False
    while engine.has_work():
        if time.perf_counter() > deadline and not out.stopped:
            out.stopped = True
            for rid in [r.rid for r in engine.requests()]:
                engine.submit(AbortRequest(rid=rid, reason="time limit"))
        before = time.perf_counter()
        result = engine.step()
        out.steps += 1
        now = time.perf_counter()
        if result.is_decode:
            out.decode_steps += 1
            out.decode_s += now - before
            out.decode_step_ends.append(now)
            out.decode_bs_sum += result.forward_tokens
            if last_was_decode:
                out.steady_decode_steps += 1
                out.steady_decode_s += now - before
        elif result.forward_tokens:
            out.extend_steps += 1
            out.extend_s += now - before
            out.extend_tokens += result.forward_tokens
        last_was_decode = result.is_decode
        for _, msg in result.outputs:
            if not isinstance(msg, StepOutput):
                raise RuntimeError(f"request failed: {msg}")
            for dl in msg.deltas:
                out.tokens += len(dl.token_ids)
                out.tokens_by_rid[dl.rid] = out.tokens_by_rid.get(dl.rid, 0) + len(dl.token_ids)
                if dl.token_ids:
                    out.first_token_at.setdefault(dl.rid, now)
                if dl.finish in ("stop", "length"):
                    out.finished += 1
    return out


def run_latency(engine: Engine, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    vocab = engine.runner.vocab_size

    def batch(prefix: str, out_len: int) -> list[TokenizedRequest]:
        ids = [random_ids(rng, a.input_len, vocab) for _ in range(a.batch_size)]
        return [request(f"{prefix}{i}", p, out_len) for i, p in enumerate(ids)]

    if a.batch_size * a.input_len > a.max_prefill_tokens:
        print(
            "note: the batch's prompts exceed --max-prefill-tokens; prefill spans several steps",
            file=sys.stderr,
        )
    # The same prompt shapes and chunking as the timed batch (fresh ids: no cache hits), so
    # its kernel variants are compiled and its decode graphs captured off the clock.
    drain(engine, batch("warmup", 2))
    reqs = batch("b", a.output_len)
    sync(engine)
    start = time.perf_counter()
    d = drain(engine, reqs)
    sync(engine)
    end = time.perf_counter()
    prefill_end = max(d.first_token_at.values())
    decode_steps = sum(1 for t in d.decode_step_ends if t > prefill_end)
    decode_s = end - prefill_end
    step_ms = 1000 * decode_s / max(decode_steps, 1)
    return {
        "batch_size": a.batch_size,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "prefill_s": prefill_end - start,
        "prefill_steps": d.extend_steps,
        "prefill_tok_s": a.batch_size * a.input_len / (prefill_end - start),
        "decode_step_ms_mean": step_ms,
        "decode_tok_s": 1000 * a.batch_size / step_ms,
        "decode_steps": decode_steps,
        "finished": d.finished,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.mode == "throughput" and a.through == "engine":
        from loadtest.offline_public import make_public_engine, run_throughput_public

        with make_public_engine(a) as public:
            result = run_throughput_public(public, a)
            device = public.pipeline.engine.runner.device
    else:
        engine = make_engine(a)
        result = run_throughput(engine, a) if a.mode == "throughput" else run_latency(engine, a)
        device = engine.runner.device
    record = {
        "mode": a.mode,
        "model": a.model or "default",
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": vars(a),
        **result,
    }
    path = Path(a.output_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    width = max(len(k) for k in result)
    print(f"== offline {a.mode} on {record['gpu'] or record['device']} ==")
    for k, v in result.items():
        print(f"{k:<{width}}  {v:.2f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return record


if __name__ == "__main__":
    main()
