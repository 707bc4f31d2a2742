"""Tensor parallelism on two GPUs at Llama-3.1-8B shapes (issue 25, run 1): TP=1 against
TP=2 in one process, one after the other, through `radixserve.Engine`.

- Greedy tokens over 64 steps on the same random bf16 checkpoint (written once, real shapes),
  with the first divergence, if any, set against TP=1's top-2 logprob gap there and the
  largest difference TP=2 made to the top logprob up to it; and the same in float32.
- Batch-1 decode tok/s (in 128, out 256), against each layout's roofline: the copy bandwidth
  of one GPU (measured here, per GPU) over the bytes one GPU reads per step (all of them for
  TP=1, half for TP=2).
- The all-reduce's share of a TP=2 decode step: NCCL kernel time on GPU 0 over the window of
  the traced steps (the device's own trace, CUDA graphs included).
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.gpu.bandwidth import copy_bandwidth
from loadtest.gpu.models import LLAMA_3_1_8B, llama8b_dir, weight_bytes
from loadtest.gpu.timeline import device_intervals

GREEDY_PROMPTS = 4
GREEDY_TOKENS = 64
DECODE_IN, DECODE_OUT = 128, 256
LM_HEAD_STD = 0.1  # wider than the rest, so greedy picks are not all near-ties
SHARD_BYTES = 4 * 2**30


def write_checkpoint(
    root: Path, config: dict[str, Any] = LLAMA_3_1_8B, device: str = "cuda:0"
) -> Path:
    """A safetensors checkpoint of random bf16 weights at `config`'s shapes, built on
    `device` by the project's own model (dummy weights) and saved under the checkpoint's
    names."""
    from safetensors.torch import save_file

    from services.executor.weights import load_model
    from services.executor.weights.loader import hf_state_dict

    path = llama8b_dir(root)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    model, _ = load_model(path, device=device, dtype=torch.bfloat16, load_format="dummy")
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_STD / 0.02)
    shard: dict[str, torch.Tensor] = {}
    size, files, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, files
        name = f"model-{files:05d}.safetensors"
        save_file(shard, str(path / name))
        weight_map.update(dict.fromkeys(shard, name))
        shard, size, files = {}, 0, files + 1

    for name, t in hf_state_dict(model).items():
        shard[name] = t.contiguous().cpu()
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def greedy(engine: Any) -> list[dict[str, Any]]:
    prompts = [
        [10 + (7 * i + 3 * j) % 250 for j in range(16 + 8 * i)] for i in range(GREEDY_PROMPTS)
    ]
    out = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=2,
    )
    return [
        {
            "ids": r["output_ids"],
            "top2": [[lp for lp, _, _ in t] for t in r["meta_info"]["output_top_logprobs"]],
        }
        for r in out
    ]


def decode_tok_s(engine: Any) -> float:
    """Batch-1 decode speed: the time of DECODE_OUT tokens less that of one, per token."""
    prompt = [10 + j % 200 for j in range(DECODE_IN)]

    def timed(n: int) -> float:
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": n, "ignore_eos": True, "temperature": 0},
        )
        return time.perf_counter() - t0

    timed(DECODE_OUT)  # warm-up
    one = min(timed(1) for _ in range(3))
    full = min(timed(DECODE_OUT) for _ in range(3))
    return (DECODE_OUT - 1) / (full - one)


def allreduce_share(engine: Any) -> dict[str, Any]:
    """NCCL kernels' time on GPU 0 over the traced decode window, at batch 1."""
    from torch.profiler import ProfilerActivity, profile

    prompt = [10 + j % 200 for j in range(DECODE_IN)]
    params = {"max_new_tokens": 96, "ignore_eos": True, "temperature": 0}
    engine.generate(input_ids=prompt, sampling_params=params)  # warm-up
    trace = Path(tempfile.mkdtemp()) / "tp2.json"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(input_ids=prompt, sampling_params=params)
    prof.export_chrome_trace(str(trace))
    intervals = device_intervals(json.loads(trace.read_text()))
    # The decode steps only: from the end of the prefill's longest kernel stretch on, take
    # the second half of the window, where every step is a replayed decode graph.
    start = intervals[0][0] + (intervals[-1][1] - intervals[0][0]) / 2
    steady = [iv for iv in intervals if iv[0] >= start]
    window = steady[-1][1] - steady[0][0]
    nccl = sum(e - s for s, e, name in steady if "nccl" in name.lower())
    busy = sum(e - s for s, e, _ in steady)
    return {
        "window_ms": window / 1000,
        "nccl_ms": nccl / 1000,
        "allreduce_share_of_step": nccl / window,
        "allreduce_share_of_busy": nccl / busy if busy else None,
        "nccl_kernels": sorted({n[:60] for _, _, n in steady if "nccl" in n.lower()}),
    }


def first_divergence(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        k = next(
            (k for k, (p, q) in enumerate(zip(x["ids"], y["ids"], strict=True)) if p != q), None
        )
        if k is None:
            out.append({"prompt": i, "identical": True})
            continue
        top = x["top2"][k]
        # What TP=2 changes where both still agree: the top logprob of the same token after
        # the same prefix; a divergence at a top-2 gap within this is a near-tie.
        pairs = zip(x["top2"][: k + 1], y["top2"][: k + 1], strict=True)
        noise = [abs(p[0] - q[0]) for p, q in pairs]
        out.append(
            {
                "prompt": i,
                "identical": False,
                "position": k,
                "tp1_top2_gap": top[0] - top[1] if len(top) == 2 else None,
                "max_top1_logprob_diff_up_to_it": max(noise),
            }
        )
    return out


def tp_section() -> dict[str, Any]:
    from radixserve import Engine

    if torch.cuda.device_count() < 2:
        return {"error": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
    bws = [copy_bandwidth(f"cuda:{d}") for d in range(2)]
    t0 = time.perf_counter()
    model = write_checkpoint(Path(tempfile.mkdtemp()))
    write_s = time.perf_counter() - t0
    wb = weight_bytes(LLAMA_3_1_8B)
    runs: dict[str, Any] = {}
    for tp in (1, 2):
        with Engine(str(model), device="cuda:0", tp_size=tp, show_progress=False) as engine:
            tokens = greedy(engine)
            tok_s = decode_tok_s(engine)
            roof = min(bws[:tp]) / (wb / tp)
            runs[f"tp{tp}"] = {
                "decode_tok_s": tok_s,
                "roofline_tok_s": roof,
                "roofline_share": tok_s / roof,
                "greedy": tokens,
            }
            if tp == 2:
                runs["tp2"]["profile"] = allreduce_share(engine)
        del engine  # shut down, it has given its GPU memory back; let go of the object too
        gc.collect()
        torch.cuda.empty_cache()
        print(f"TP={tp}: {runs[f'tp{tp}']['decode_tok_s']:.1f} tok/s", flush=True)
    divergence = first_divergence(runs["tp1"]["greedy"], runs["tp2"]["greedy"])
    # The same comparison in float32, where rounding cannot explain an early divergence.
    fp32 = []
    for tp in (1, 2):
        with Engine(
            str(model), device="cuda:0", tp_size=tp, dtype="float32", show_progress=False
        ) as engine:
            fp32.append(greedy(engine))
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return {
        "gpu": torch.cuda.get_device_name(0),
        "copy_bandwidth_TBps": [b / 1e12 for b in bws],
        "weight_bytes": wb,
        "checkpoint_write_s": write_s,
        "speedup_tp2_over_tp1": runs["tp2"]["decode_tok_s"] / runs["tp1"]["decode_tok_s"],
        "greedy_tp1_vs_tp2": divergence,
        "greedy_tp1_vs_tp2_float32": first_divergence(*fp32),
        **runs,
    }
