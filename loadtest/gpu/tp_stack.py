"""Tensor parallelism through the whole stack on two GPUs (issue 25, runs 2 and 4).

- `tp70b`: Llama-3.1-70B's shapes (141 GB in bf16, dummy weights) served by
  `radixserve serve --tp-size 2`: each rank builds only its half. Batch-1 decode through the
  stack (one streamed request, in 128 / out 256: the time between its first and last token)
  against the two-GPU roofline, then SGLang's offline workload (500 prompts, input
  U[1, 4096], output U[1, 2048], all sent at once) with the output tok/s it reaches.
- `tp_kill`: a TP=2 group at Llama-3.1-8B's shapes under load loses its rank 1 to SIGKILL:
  every request in flight gets an answer (a clear 503 where no executor was left to resume
  it), the supervisor restarts the group, and serving resumes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.dp_bench import stop
from loadtest.gpu.bandwidth import copy_bandwidth
from loadtest.gpu.models import LLAMA_3_1_8B, llama8b_dir, weight_bytes
from loadtest.gpu.sections import _serve

LLAMA_3_1_70B: dict[str, Any] = {
    **LLAMA_3_1_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
PORT = 18200


def _model(config: dict[str, Any]) -> Path:
    path = llama8b_dir(Path(tempfile.mkdtemp()), tokenizer="words")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _own_db(db: int) -> dict[str, str]:
    """A Redis database of its own for a stack, on the machine's shared Redis (streams left by
    an earlier stack's killed services must not reach this one's)."""
    shared = os.environ.get("REDIS_URL")
    return {"REDIS_URL": f"{shared.rsplit('/', 1)[0]}/{db}"} if shared else {}


async def _stream_times(url: str, prompt: list[int], out: int) -> list[float]:
    """Arrival times of a streamed /generate's chunks."""
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": out, "ignore_eos": True, "temperature": 0},
    }
    times: list[float] = []
    async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return times


def batch1_decode(url: str, out: int = 256) -> float:
    """Tokens per second between the first and the last streamed token of one request (the
    best of three; the stream sends one chunk per token at batch 1)."""
    prompt = [10 + j % 200 for j in range(128)]
    best = 0.0
    for _ in range(3):
        times = asyncio.run(_stream_times(url, prompt, out))
        best = max(best, (len(times) - 1) / (times[-1] - times[0]))
    return best


def offline_500(url: str, model: Path) -> dict[str, Any]:
    from loadtest import serving
    from loadtest.flags import build_parser

    args = build_parser().parse_args(
        [
            *("--base-url", url, "--backend", "radixserve", "--tokenizer", str(model)),
            *("--disable-tqdm", "--seed", "1", "--dataset-name", "random", "--num-prompts", "500"),
            *("--random-input-len", "4096", "--random-output-len", "2048"),
            *("--random-range-ratio", "0.0", "--request-rate", "inf"),
        ]
    )
    m = asyncio.run(serving.benchmark(args))
    return m.to_json()


def tp70b_section(log_dir: str) -> dict[str, Any]:
    import torch

    bws = [copy_bandwidth(f"cuda:{d}") for d in range(2)]
    model = _model(LLAMA_3_1_70B)
    t0 = time.monotonic()
    proc = _serve(model, Path(log_dir) / "serve_tp70b.log", PORT, "--tp-size", "2", env=_own_db(12))
    ready_s = time.monotonic() - t0
    url = f"http://127.0.0.1:{PORT}"
    wb = weight_bytes(LLAMA_3_1_70B)
    try:
        tok_s = batch1_decode(url)
        roof = min(bws) / (wb / 2)
        print(f"70B TP=2 batch-1: {tok_s:.1f} tok/s = {tok_s / roof:.0%} of {roof:.1f}", flush=True)
        offline = offline_500(url, model)
        print(f"70B TP=2 offline 500: {offline['output_throughput']:.0f} tok/s", flush=True)
    finally:
        stop(proc)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "copy_bandwidth_TBps": [b / 1e12 for b in bws],
        "weight_bytes": wb,
        "ready_s": ready_s,
        "decode_tok_s": tok_s,
        "roofline_tok_s": roof,
        "roofline_share": tok_s / roof,
        "offline_500": offline,
    }


async def _one(s: aiohttp.ClientSession, url: str, i: int, out: int) -> tuple[int, str]:
    body = {"prompt": [10 + (i + j) % 200 for j in range(64)], "max_tokens": out}
    body["ignore_eos"] = True
    try:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            text = await r.text()
            return r.status, text[:300] if r.status != 200 else ""
    except aiohttp.ClientError as e:
        return -1, repr(e)


async def _load(url: str, n: int, out: int) -> list[tuple[int, str]]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        return await asyncio.gather(*(_one(s, url, i, out) for i in range(n)))


def _rank1_pids() -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", "services.executor.distributed.rank"], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


def tp_kill_section(log_dir: str) -> dict[str, Any]:
    model = _model(LLAMA_3_1_8B)
    log = Path(log_dir) / "serve_tp_kill.log"
    proc = _serve(model, log, PORT + 1, "--tp-size", "2", "--resume-wait", "5", env=_own_db(13))
    url = f"http://127.0.0.1:{PORT + 1}"
    try:
        before = asyncio.run(_load(url, 16, 32))

        async def killed_mid_load() -> tuple[list[tuple[int, str]], list[int]]:
            load = asyncio.ensure_future(_load(url, 128, 1024))
            await asyncio.sleep(3.0)  # the requests are decoding by now (1,024 tokens each)
            pids = _rank1_pids()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return await load, pids

        t0 = time.monotonic()
        during, killed = asyncio.run(killed_mid_load())
        answered_s = time.monotonic() - t0
        deadline = time.monotonic() + 300
        while True:  # the supervisor brings the group back; wait for it to serve again
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited: {log.read_text()[-3000:]}")
            try:
                back = asyncio.run(_load(url, 16, 32))
                if all(code == 200 for code, _ in back):
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"serving did not resume: {log.read_text()[-3000:]}")
            time.sleep(2)
        back_s = time.monotonic() - t0
    finally:
        stop(proc)
    codes: dict[str, int] = {}
    for code, _ in during:
        codes[str(code)] = codes.get(str(code), 0) + 1
    return {
        "killed_pids": killed,
        "before_ok": sum(code == 200 for code, _ in before),
        "during_codes": codes,
        "during_errors_sample": sorted({text for code, text in during if code != 200})[:3],
        "all_answered_after_s": answered_s,
        "serving_again_after_s": back_s,
        "after_ok": sum(code == 200 for code, _ in back),
    }
