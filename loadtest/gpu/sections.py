"""One function per figure the GPU issue reports; each returns a JSON-able dict.

Each runs in its own process (see loadtest/gpu_bench.py) so GPU memory is fresh every time.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loadtest import offline
from loadtest.gpu.bandwidth import copy_bandwidth
from loadtest.gpu.hosttime import HostTimes
from loadtest.gpu.models import LLAMA_3_1_8B, llama8b_dir, weight_bytes
from services.executor.weights.loader import hf_state_dict

# SGLang's offline workload: 500 prompts, input U[1, 4096], output U[1, 2048].
OFFLINE_500 = (
    *("--num-prompts", "500", "--input-len", "4096", "--output-len", "2048"),
    *("--range-ratio", "0.0"),
)


def _args(model: Path, mode: str, *extra: str) -> Any:
    return offline.parse_args([mode, "--model", str(model), "--load-format", "dummy", *extra])


def roofline() -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written) and the batch-1 decode floor."""
    bw = copy_bandwidth()
    wb = weight_bytes(LLAMA_3_1_8B)
    return {
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth_TBps": bw / 1e12,
        "weight_bytes_per_step": wb,
        "decode_floor_ms": 1000 * wb / bw,
        "decode_roofline_tok_s": bw / wb,
    }


def correctness(
    archs: tuple[str, ...] = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "deepseek_v2"),
) -> dict[str, Any]:
    """Greedy tokens of small random-weight models (`archs`, write_tiny_model's names; Phi-3,
    Gemma's windows and soft caps, and DeepSeek's latent attention among the defaults) in bf16
    on the Triton backend with CUDA graphs, against transformers on the same weights; CUDA-graph
    and eager decode agree."""
    from transformers import AutoModelForCausalLM

    from tests.executor.helpers import write_tiny_model

    out: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp())
    for arch in archs:
        path = write_tiny_model(root, arch, seed=1, max_position_embeddings=1024)
        hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        hf = hf.cuda().eval()
        prompts = [[(7 * i + 3 * j) % 250 for j in range(5 + 9 * i)] for i in range(6)]
        ours = {}
        for graphs in (True, False):
            extra = [] if graphs else ["--disable-cuda-graph"]
            args = offline.parse_args(
                ["latency", "--model", str(path), "--max-total-tokens", "65536", *extra]
            )
            engine = offline.make_engine(args)
            reqs = [with_logprobs(offline.request(f"p{i}", p, 64)) for i, p in enumerate(prompts)]
            tokens: dict[str, list[int]] = {r.trace.rid: [] for r in reqs}
            lps: dict[str, list[float]] = {r.trace.rid: [] for r in reqs}
            for r in reqs:
                engine.submit(r)
            while engine.has_work():
                for _, msg in engine.step().outputs:
                    for d in getattr(msg, "deltas", []):
                        tokens[d.rid] += d.token_ids
                        if d.logprobs is not None:
                            lps[d.rid] += [x for x in d.logprobs.logprobs if x is not None]
            ours[graphs] = [tokens[f"p{i}"] for i in range(len(prompts))]
            if graphs:
                our_lps = [lps[f"p{i}"] for i in range(len(prompts))]
            del engine
        matches, flips = 0, []
        for i, p in enumerate(prompts):
            with torch.no_grad():
                ids = torch.tensor([p], device="cuda")
                ref = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),  # else token 0, the pad id, is masked
                    do_sample=False,
                    max_new_tokens=64,
                    min_new_tokens=64,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
            got = ours[True][i]
            same = next((k for k, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), 64)
            matches += same == 64
            if same < 64:  # explain the flip: the top-2 gap of HF's logits at that position
                with torch.no_grad():
                    logits = hf(torch.tensor([p + ref[:same]], device="cuda")).logits[0, -1]
                top2 = logits.float().topk(2).values
                flips.append({"prompt": i, "position": same, "top2_gap": float(top2[0] - top2[1])})
        # Logit-level agreement along our own tokens: HF's logprob of each token we chose,
        # teacher-forced, against ours (both raw log-softmax of bf16 logits).
        worst = 0.0
        for i, p in enumerate(prompts):
            with torch.no_grad():
                seq = torch.tensor([p + ours[True][i]], device="cuda")
                ref_lp = torch.log_softmax(hf(seq).logits[0].float(), dim=-1)
            idx = torch.tensor(ours[True][i], device="cuda")
            want = ref_lp[len(p) - 1 : -1].gather(1, idx[:, None]).squeeze(1)
            got_lp = torch.tensor(our_lps[i], device="cuda")
            worst = max(worst, float((want - got_lp).abs().max()))
        out[arch] = {
            "max_abs_logprob_diff_vs_hf": worst,
            "prompts": len(prompts),
            "identical_64_tokens": matches,
            "flips": flips,
            "graph_equals_eager": ours[True] == ours[False],
        }
        del hf
        torch.cuda.empty_cache()
    return out


def with_logprobs(r: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(
        r, sampling=msgspec.structs.replace(r.sampling, return_logprob=True, top_logprobs=2)
    )


def decode_batch1(profile_dir: str = "") -> dict[str, Any]:
    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root)
    args = _args(model, "latency", "--batch-size", "1", "--input-len", "128", "--output-len", "256")
    engine = offline.make_engine(args)
    result = offline.run_latency(engine, args)
    result["gpu_busy_fraction"] = _gpu_busy_fraction(engine, profile_dir)
    return result


def _gpu_busy_fraction(engine: Any, profile_dir: str) -> float:
    """Share of wall time the GPU spends in kernels over 32 decode steps at batch 8."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(8):
        engine.submit(offline.request(f"prof{i}", list(range(100, 228)), 64))
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(32):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    if profile_dir:
        prof.export_chrome_trace(str(Path(profile_dir) / "decode_trace.json"))
    kernel_us = sum(
        e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"
    )
    return float(kernel_us / 1e6 / wall)


def peer_hf(batch: int = 32, input_len: int = 512, output_len: int = 256) -> dict[str, Any]:
    """transformers generate() and radixserve on the same weights and the same batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root)
    tokens = batch * (input_len + output_len) + 4096
    args = _args(
        model,
        "latency",
        "--batch-size",
        str(batch),
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--max-total-tokens",
        str(tokens),
    )
    engine = offline.make_engine(args)
    cfg: dict[str, Any] = {k: v for k, v in LLAMA_3_1_8B.items() if k != "architectures"}
    with torch.device("cuda"):
        hf: Any = LlamaForCausalLM(LlamaConfig(**cfg))
    hf = hf.to(torch.bfloat16).eval()
    hf.load_state_dict(hf_state_dict(engine.runner.model))
    ids = torch.randint(1000, 100000, (batch, input_len), device="cuda")
    with torch.no_grad():
        # Both sides warm up on the measured shapes (cuBLAS and Triton pick kernels per shape).
        hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        hf_s = time.perf_counter() - t0
    hf_first = out[0, input_len : input_len + 8].tolist()
    del hf, out
    torch.cuda.empty_cache()
    reqs = [offline.request(f"b{i}", ids[i].tolist(), output_len) for i in range(batch)]
    offline.drain(engine, [offline.request(f"w{i}", ids[i].tolist(), 4) for i in range(batch)])
    engine.flush_cache()  # the measured run computes its prompts, as generate() does
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    d = offline.drain(engine, reqs)
    torch.cuda.synchronize()
    ours_s = time.perf_counter() - t0
    return {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "hf_output_tok_s": batch * output_len / hf_s,
        "radixserve_output_tok_s": d.tokens / ours_s,
        "speedup": (d.tokens / ours_s) / (batch * output_len / hf_s),
        "hf_first_tokens_of_request_0": hf_first,
    }


def offline_throughput(
    time_limit: float = 400.0, kv_cache_dtype: str = "auto", quantization: str = "auto"
) -> dict[str, Any]:
    """SGLang's CI workload: 500 prompts at once, input U[1, 4096], output U[1, 2048].

    kv_cache_dtype: --kv-cache-dtype (fp8_e5m2 halves the KV reads decode attention is bound
    by, and doubles the pool's tokens). quantization: --quantization (fp8: half the weight
    bytes, and the memory they free goes to the pool)."""
    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root)
    args = _args(
        model,
        "throughput",
        *OFFLINE_500,
        "--time-limit",
        str(time_limit),
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--quantization",
        quantization,
    )
    engine = offline.make_engine(args)
    host = HostTimes(engine)
    result = offline.run_throughput(engine, args)
    result["kv_pool_tokens"] = engine.policy.kv.num_slots
    result["host_ms_per_step"] = host.per_step()
    result["kv_cache_dtype"] = str(engine.policy.kv.dtype).removeprefix("torch.")
    quant = engine.runner.model.quantization
    result["weights"] = quant.name if quant is not None else "bfloat16"
    result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    result["total_gib"] = torch.cuda.mem_get_info()[1] / 2**30
    return result


def decode_heavy_offline() -> dict[str, Any]:
    """The in-process half of the bus-overhead comparison: 64 prompts of 128 tokens, 512 out."""
    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root)
    args = _args(
        model,
        "throughput",
        "--num-prompts",
        "64",
        "--input-len",
        "128",
        "--output-len",
        "512",
        "--range-ratio",
        "1.0",
    )
    engine = offline.make_engine(args)
    host = HostTimes(engine)
    result = offline.run_throughput(engine, args)
    result["host_ms_per_step"] = host.per_step()
    return result


# The decode-heavy workload of the bus-overhead comparison: 64 prompts at once, 128 in, 512 out.
DECODE_HEAVY = (
    "--dataset-name",
    "random",
    "--num-prompts",
    "64",
    "--random-input-len",
    "128",
    "--random-output-len",
    "512",
    "--random-range-ratio",
    "1.0",
)


def stop_serve(proc: Any) -> None:
    """Ctrl-C to a `_serve` process, killed if it has not stopped within a minute."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except Exception:
        proc.kill()


def _serve(
    model: Path, log: Path, port: int, *extra: str, env: dict[str, str] | None = None
) -> Any:
    """`radixserve serve` with dummy weights (and `extra` flags, and `env` over this
    process's environment); returns the process once /health is 200."""
    import os
    import subprocess
    import sys
    import urllib.request

    env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve",
            "serve",
            "--model",
            str(model),
            "--load-format",
            "dummy",
            "--port",
            str(port),
            *extra,
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"serve not ready: {log.read_text()[-3000:]}")


def hop_table(runs: dict[str, Any]) -> str:
    """Median ms per stage of each run's first tokens (Metrics.hop_median_ms), one column per
    run, so the stage that grows under load stands out."""
    stages = list(dict.fromkeys(k for m in runs.values() for k in (m.hop_median_ms or {})))
    lines = ["first token, median ms per stage".ljust(20) + "".join(f"{n:>14}" for n in runs)]
    for stage in stages:
        cells = [(m.hop_median_ms or {}).get(stage) for m in runs.values()]
        lines.append(
            stage.ljust(20) + "".join("n/a".rjust(14) if c is None else f"{c:14.2f}" for c in cells)
        )
    return "\n".join(lines)


def online(log_dir: str) -> dict[str, Any]:
    """Through the whole service stack: 100 prompts at 1 request/s (input U[1, 4096], output
    U[1, 2048]), then the decode-heavy workload of the bus-overhead comparison. Every run asks
    where each first token's time went (--hop-latency); the 1 req/s run's per-stage medians
    are printed beside the alone run's, the comparison that locates TTFT under load."""
    import asyncio

    from loadtest import serving
    from loadtest.flags import build_parser

    root = Path(tempfile.mkdtemp())
    model = llama8b_dir(root, tokenizer="words")
    port = 18000
    log = Path(log_dir) / "serve_online.log"
    proc = _serve(model, log, port)
    base = [
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--backend",
        "radixserve",
        "--tokenizer",
        str(model),
        "--disable-tqdm",
        "--seed",
        "1",
        "--hop-latency",
    ]

    def run(*flags: str) -> Any:
        return asyncio.run(serving.benchmark(build_parser().parse_args([*base, *flags])))

    try:
        # The floor under TTFT through the stack: one 2,048-token prompt at a time.
        alone = run(
            "--dataset-name",
            "random",
            "--num-prompts",
            "8",
            "--max-concurrency",
            "1",
            "--random-input-len",
            "2048",
            "--random-output-len",
            "2",
            "--random-range-ratio",
            "1.0",
            "--warmup-requests",
            "2",
        )
        latency = run(
            "--dataset-name",
            "random",
            "--num-prompts",
            "100",
            "--request-rate",
            "1",
            "--random-input-len",
            "4096",
            "--random-output-len",
            "2048",
            "--random-range-ratio",
            "0.0",
            "--warmup-requests",
            "2",
        )
        heavy = run(
            *DECODE_HEAVY,
            "--warmup-requests",
            "2",
        )
    finally:
        stop_serve(proc)
    print(hop_table({"alone 2048": alone, "1 req/s": latency}), flush=True)
    return {
        "ttft_alone_2048": alone.to_json(),
        "latency_1rps": latency.to_json(),
        "decode_heavy": heavy.to_json(),
    }
