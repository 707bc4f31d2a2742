"""Mixture-of-experts on the GPU, at Qwen3-30B-A3B's shapes (dummy weights).

moe_kernel: kernels/fused_moe against a torch loop over the experts that have tokens (what
transformers does), at 1, 64 and 512 tokens; eager and, at each size, inside a CUDA graph (as
decode runs it); the share of copy bandwidth the kernel reaches reading the experts in use.
Then the tiny Qwen2-MoE, Qwen3-MoE and Mixtral models in bf16 through the engine (Triton
kernels, CUDA graphs) against transformers, as the `correctness` section does for dense ones.

qwen3moe: the whole model through the engine. Batch-1 decode tok/s against the roofline of
the bytes one step actually reads (attention, norms and router of every layer, the top-k
experts each layer routes to, the LM head, the KV cache), at the copy bandwidth measured in
the same run; then SGLang's offline workload (500 prompts, input U[1, 4096], output
U[1, 2048]) on the same engine, as the `offline` section runs it for Llama.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loadtest import offline
from loadtest.gpu.bandwidth import copy_bandwidth
from loadtest.gpu.timeline import profile_decode

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
TOKENS = (1, 2, 4, 8, 64, 512)
OFFLINE_RUN_S = 130  # the 500-prompt run stops here and reports what it finished


def model_dir(root: Path, name: str, config: dict[str, Any]) -> Path:
    """`config` as config.json beside the tiny byte tokenizer (dummy-weight serving)."""
    from tests.executor.helpers import make_tokenizer

    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    make_tokenizer().save_pretrained(path)
    return path


def step_bytes(config: dict[str, Any], context: int, experts_read: int) -> dict[str, int]:
    """bf16 bytes one batch-1 decode step reads, by part: every layer's attention
    projections, norms and router, `experts_read` experts per layer (top-k at batch 1), the
    KV cache of `context` tokens, the LM head (the embedding: one row, left out)."""
    h, n = config["hidden_size"], config["num_hidden_layers"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter, experts = config["moe_intermediate_size"], config["num_experts"]
    attention = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd  # q, o; k, v; q/k norms
    parts = {
        "attention": 2 * n * attention,
        "norms": 2 * (n * 2 * h + h),
        "router": 2 * n * experts * h,
        "experts": 2 * n * experts_read * 3 * h * inter,
        "kv_cache": 2 * n * 2 * kv * hd * context,
        "lm_head": 2 * h * config["vocab_size"],
    }
    parts["total"] = sum(parts.values())
    return parts


def _time_ms(fn: Callable[[], object], reps: int = 50) -> float:
    """Mean milliseconds per call, back to back on the stream (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def torch_loop_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The baseline: a loop over the experts that have tokens, cuBLAS bf16 matmuls per
    expert (transformers' MoE forward, without its one-hot mask)."""
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    for expert in torch.unique(flat).tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        rows = pairs // top_k
        gate, up = F.linear(x[rows], w13[expert]).split(inter, dim=-1)
        down = F.linear(F.silu(gate) * up, w2[expert])
        w = topk_weights.reshape(-1)[pairs].to(x.dtype)
        out.index_add_(0, rows, down * w[:, None])
    return out


def moe_kernel_section() -> dict[str, Any]:
    from loadtest.gpu.sections import correctness

    bw = copy_bandwidth()
    rows = _kernel_timings(bw)
    torch.cuda.empty_cache()
    cfg = QWEN3_30B_A3B
    shape = {
        "experts": cfg["num_experts"],
        "top_k": cfg["num_experts_per_tok"],
        "hidden": cfg["hidden_size"],
        "moe_intermediate": cfg["moe_intermediate_size"],
    }
    return {
        "gpu": torch.cuda.get_device_name(),
        "shape": shape,
        "copy_bandwidth_TBps": bw / 1e12,
        "tokens": rows,
        "correctness": correctness(("qwen2_moe", "qwen3_moe", "mixtral")),
    }


def _kernel_timings(bw: float) -> dict[str, Any]:
    """fused_moe (eager and graphed) and the torch loop at each of TOKENS, by token count."""
    from kernels.fused_moe import fused_moe

    cfg = QWEN3_30B_A3B
    experts, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, h, device="cuda", generator=gen).mul_(0.02)
    w2 = torch.randn(experts, h, inter, device="cuda", generator=gen).mul_(0.02)
    w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    rows: dict[str, Any] = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)

        def fused() -> torch.Tensor:
            return fused_moe(x, w13, w2, topk_weights, topk_ids)  # noqa: B023

        def loop() -> torch.Tensor:
            return torch_loop_moe(x, w13, w2, topk_weights, topk_ids)  # noqa: B023

        diff = float((fused().float() - loop().float()).abs().max())
        fused_ms, loop_ms = _time_ms(fused), _time_ms(loop, reps=10)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused()
        graph_ms = _time_ms(graph.replay)
        used = int(torch.unique(topk_ids).numel())
        expert_bytes = used * 3 * h * inter * 2
        rows[str(tokens)] = {
            "experts_used": used,
            "fused_ms": fused_ms,
            "fused_graph_ms": graph_ms,
            "torch_loop_ms": loop_ms,
            "speedup": loop_ms / fused_ms,
            "speedup_graph": loop_ms / graph_ms,
            "expert_bytes": expert_bytes,
            # weights read / time, against copy bandwidth (bytes read + written)
            "graph_share_of_copy_bw": expert_bytes / (graph_ms / 1000) / bw,
            "max_abs_diff_vs_loop": diff,
        }
        args = (x, w13, w2, topk_weights, topk_ids)
        if tokens <= 64:
            grouped = partial(fused_moe, *args, path="grouped")
            rows[str(tokens)]["tiles"] = _config_grid(grouped, TILE_GRID, TILE_ARGS, "tiles")
        if tokens <= 8:  # where kernels/moe_gemv may take over from the grouped GEMM
            from kernels.moe_gemv import moe_gemv

            gemv = partial(moe_gemv, *args)
            rows[str(tokens)]["gemv"] = _config_grid(gemv, GEMV_GRID, GEMV_ARGS, "config")
        print(f"moe_kernel {tokens} tokens: {rows[str(tokens)]}", flush=True)
    return rows


# fused_moe's grouped GEMM launch configurations tried at decode sizes
TILE_ARGS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
TILE_GRID = [
    (16, 32, 128, 4, 3),
    (16, 64, 128, 4, 3),
    (16, 32, 256, 4, 3),
    (16, 64, 64, 4, 4),
    (16, 128, 64, 4, 3),
    (16, 32, 64, 2, 4),
    (16, 64, 128, 8, 3),
    (16, 16, 256, 4, 3),
]


# kernels/moe_gemv's launch configurations tried at decode sizes
GEMV_ARGS = ("block_n", "block_k", "num_warps", "num_stages")
GEMV_GRID = [
    (8, 256, 4, 3),
    (4, 512, 4, 3),
    (16, 128, 4, 3),
    (8, 512, 4, 2),
    (4, 256, 2, 4),
    (16, 256, 8, 3),
    (2, 512, 4, 3),
    (32, 128, 4, 3),
    (8, 128, 2, 4),
]


def _config_grid(
    launch: Callable[..., object], grid: Sequence[tuple[int, ...]], names: tuple[str, ...], key: str
) -> list[dict[str, Any]]:
    """`launch`'s graphed time under each launch configuration of `grid` (values of the
    keyword arguments `names`), fastest first; each row names its configuration under `key`."""
    out: list[dict[str, Any]] = []
    for values in grid:
        call = partial(launch, **dict(zip(names, values, strict=True)))
        out.append({key: list(values), **_graph_ms(call)})
    return sorted(out, key=lambda r: r.get("graph_ms", float("inf")))


def _graph_ms(call: Callable[[], object]) -> dict[str, Any]:
    """{"graph_ms": replay time of `call` captured in a CUDA graph}, or {"error": ...} for a
    configuration the GPU cannot hold (shared memory)."""
    try:
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        return {"graph_ms": _time_ms(graph.replay)}
    except Exception as e:
        return {"error": str(e)[:120]}


def qwen3moe_section(time_limit: float = OFFLINE_RUN_S) -> dict[str, Any]:
    read = step_bytes(QWEN3_30B_A3B, DECODE_IN + DECODE_OUT // 2, 8)
    return decode_and_offline(QWEN3_30B_A3B, "qwen3-30b-a3b-dummy", read, time_limit)


DECODE_IN, DECODE_OUT = 128, 256
BATCHES = (1, 4, 8)  # decode_batches' batch sizes


def qwen3moe_batches_section() -> dict[str, Any]:
    return decode_batches(QWEN3_30B_A3B, "qwen3-30b-a3b-dummy")


def qwen3moe_fp8_section() -> dict[str, Any]:
    """Qwen3-30B-A3B as its FP8 release holds it (every projection and expert e4m3 with
    128x128 block scales; router, norms and LM head bf16) against bf16, decode at BATCHES,
    both in this process: tok/s, the ratio, and each one's share of its own roofline (bytes
    read per batch-1 step at the copy bandwidth)."""
    import gc

    from services.executor.quant.fp8_checkpoint import quantization_config

    bw = copy_bandwidth()
    read = step_bytes(QWEN3_30B_A3B, DECODE_IN + DECODE_OUT // 2, 8)
    fp8 = fp8_step_bytes(read)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12}
    for name, config in (
        ("bf16", QWEN3_30B_A3B),
        ("fp8_block", {**QWEN3_30B_A3B, "quantization_config": quantization_config("block")}),
    ):
        r = decode_batches(config, f"qwen3-30b-a3b-{name}-dummy")
        one = r["batches"]["1"]["decode_tok_s"]
        r["roofline_tok_s"] = bw / (fp8 if name == "fp8_block" else read["total"])
        r["share_of_roofline"] = one / r["roofline_tok_s"]
        out[name] = r
        gc.collect()  # the next engine needs this one's memory
        torch.cuda.empty_cache()
    out["ratio_by_batch"] = {
        bs: out["fp8_block"]["batches"][bs]["decode_tok_s"] / r["decode_tok_s"]
        for bs, r in out["bf16"]["batches"].items()
    }
    return out


def fp8_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """gpu_bench's summary lines for qwen3moe_fp8: each batch size's tok/s both ways and the
    ratio, and batch 1 against each one's roofline."""
    rows = []
    for bs, ratio in result.get("ratio_by_batch", {}).items():
        bf16 = result["bf16"]["batches"][bs]["decode_tok_s"]
        fp8 = result["fp8_block"]["batches"][bs]["decode_tok_s"]
        rows.append((f"Qwen3-30B-A3B FP8 (blocks) decode at batch {bs}",
                     f"{fp8:.0f} tok/s against bf16's {bf16:.0f}: {ratio:.2f}x"))  # fmt: skip
    for name in ("bf16", "fp8_block"):
        r = result.get(name, {})
        if "share_of_roofline" in r:
            share = f"{100 * r['share_of_roofline']:.1f}% of {r['roofline_tok_s']:.0f} tok/s"
            rows.append((f"Qwen3-30B-A3B {name} batch 1 against its roofline", share))
    return rows


def fp8_step_bytes(read: dict[str, int]) -> int:
    """A batch-1 step's bytes with the attention projections and experts in e4m3 (one byte
    a weight, plus an fp32 scale per 128x128 block) and the rest as `read` has it."""
    scaled = (read["attention"] + read["experts"]) // 2
    return read["total"] - read["attention"] - read["experts"] + scaled + scaled // 4096


def decode_batches(
    config: dict[str, Any], name: str, batch_sizes: Sequence[int] = BATCHES
) -> dict[str, Any]:
    """Decode (in DECODE_IN, out DECODE_OUT) at each batch size on one engine: each step's
    mean time and output tok/s, what a change to the expert launches is measured by above
    batch 1 (the tiles `kernels/fused_moe.choose_tiles` gives a few tokens per expert)."""
    model = model_dir(Path(tempfile.mkdtemp()), name, config)
    # sized for the largest batch; every smaller one runs on the same engine and graphs
    engine = offline.make_engine(decode_args(model, max(batch_sizes)))
    batches = {}
    for bs in batch_sizes:
        batches[str(bs)] = offline.run_latency(engine, decode_args(model, bs))
    return {"gpu": torch.cuda.get_device_name(), "batches": batches}


def decode_args(model: Path, batch_size: int) -> Any:
    """The offline latency run's arguments: `batch_size` requests, in DECODE_IN, out
    DECODE_OUT."""
    from loadtest.gpu.sections import _args

    lens = ("--input-len", str(DECODE_IN), "--output-len", str(DECODE_OUT))
    return _args(model, "latency", "--batch-size", str(batch_size), *lens)


def batch_rows(label: str, result: dict[str, Any]) -> list[tuple[str, str]]:
    """gpu_bench's summary lines for a decode_batches result."""
    return [
        (
            f"{label} decode at batch {bs} (in {DECODE_IN}, out {DECODE_OUT})",
            f"{r['decode_step_ms_mean']:.3f} ms a step, {r['decode_tok_s']:.0f} tok/s",
        )
        for bs, r in result.get("batches", {}).items()
    ]


def decode_and_offline(
    config: dict[str, Any], name: str, read: dict[str, int], time_limit: float
) -> dict[str, Any]:
    """Batch-1 decode (in DECODE_IN, out DECODE_OUT) against the roofline of `read` (bytes
    per step at the mean context) and its device timeline, then the 500-prompt offline
    workload on the same engine for `time_limit` seconds (none when it is 0)."""
    from loadtest.gpu.sections import OFFLINE_500, _args

    bw = copy_bandwidth()  # its buffers are back on the device before the KV pool is sized
    model = model_dir(Path(tempfile.mkdtemp()), name, config)
    args = decode_args(model, 1)
    t0 = time.monotonic()
    engine = offline.make_engine(args)
    startup_s = time.monotonic() - t0
    decode = offline.run_latency(engine, args)
    roofline_tok_s = bw / read["total"]
    # where a batch-1 step's device time goes, kernel by kernel
    prompt = [(7 * j) % 200 + 10 for j in range(DECODE_IN)]
    timeline = profile_decode(engine, [offline.request("t", prompt, 512)], 8, 30, top_kernels=40)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "startup_s": startup_s,
        "copy_bandwidth_TBps": bw / 1e12,
        "bytes_per_step": read,
        "decode_roofline_tok_s": roofline_tok_s,
        "decode1": decode,
        "decode_share_of_roofline": decode["decode_tok_s"] / roofline_tok_s,
        "target_share": 0.70,
        "decode1_timeline": timeline,
    }
    print(f"{name} decode: {result}", flush=True)
    if time_limit <= 0:
        return result
    thr = _args(model, "throughput", *OFFLINE_500, "--time-limit", str(time_limit))
    result["offline"] = offline.run_throughput(engine, thr)
    result["offline"]["kv_pool_tokens"] = engine.policy.kv.num_slots
    result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return result
