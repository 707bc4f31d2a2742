"""Everything the GPU issue reports, on one GPU machine, within ten minutes a command.

    python -m loadtest.gpu_bench [--sections roofline,correctness,...] [--out DIR]

Each section runs in its own process (fresh GPU memory) with its own time limit; results go to
DIR/gpu_bench.json (DIR: --out, else $OUT, else results/) and a short table is printed last.
Sections: roofline, correctness, decode1, peer, heavy, structured, offline, offline_fp8 (the
same 500 prompts with --kv-cache-dtype fp8_e5m2), online, profile, prefill; and, only when
named, burst (2,000 requests at once and the shared-prefix workload at concurrency 256 through
`radixserve serve`, counting lost requests) and engine_ab (the public `radixserve.Engine`
against the executor's engine stepped directly, alternating on one engine: gpu/engine_ab.py),
protocols (HTTP against gRPC on one `radixserve serve`: gpu/protocols.py) and dp (two executors
on the one GPU, the shared-prefix workload routed cache_aware and round_robin, and one executor
for reference: gpu/dp.py), tools (tool_choice required against plain chat: gpu/tools.py) and
tp (TP=1 against TP=2 on two GPUs: gpu/tp.py), tp70b (Llama-3.1-70B's shapes on TP=2 through
the stack) and tp_kill (a TP=2 group losing a rank under load: gpu/tp_stack.py), mla_kernel
(the MLA decode kernel's latent-cache bandwidth at DeepSeek-V2-Lite's shapes against the copy
bandwidth: gpu/mla_kernel.py), moe_kernel (the fused MoE kernel against a torch loop over
experts) and qwen3moe (Qwen3-30B-A3B's shapes: batch-1 decode against its roofline, the
500-prompt offline workload: gpu/moe.py) and dsv2lite (DeepSeek-V2-Lite's shapes, MLA and
MoE: the same two figures, gpu/deepseek.py); qwen3moe_decode and dsv2lite_decode run the
decode half alone, qwen3moe_batches and dsv2lite_batches decode at batch 1, 4 and 8,
qwen3moe_fp8 the same for Qwen3-30B-A3B in bf16 and in its FP8 release's layout,
moe_fp8_tiles its expert launches alone, cold, at 1 and 4 tokens (gpu/moe_fp8.py); scale
(decode at long contexts and big batches against its roofline, the 100,000-token prefill,
host time per step at batch 256: gpu/scale.py), gguf_kernel (GGUF
Q8_0/Q4_K/Q6_K blocks: the decode GEMV's bandwidth at Llama-3.1-8B's shapes, rows past it
expanded for cuBLAS: gpu/gguf_kernel.py), w4a16_kernel (the int4 GEMV, GEMM and dequantise +
cuBLAS at Llama-3.1-8B's projection shapes against bf16, the prefill paths' crossover:
gpu/w4a16.py), w4a16_mma (the int4 decode MMA at 1 to 64 rows against the GEMV and GEMM it
replaced, cold weights, and the expansion of its shuffled words: gpu/w4a16_mma.py);
quant_decode (batch-1 decode with bf16, fp8 per-channel, fp8 block and GGUF
Q4_K weights, each against its own roofline: gpu/quant.py; quant_decode_int4 the same with
bf16, int4 AWQ and int4 GPTQ; quant_decode_act_order bf16 and int4 GPTQ without and with
act-order; quant_decode_batch32 and quant_decode_batch64 bf16 and int4 AWQ at 32 and 64
requests at once; quant_prefill_int4 a 4,096-token prompt's prefill with bf16,
int4 AWQ and GGUF Q4_K weights) and offline_fp8w (the 500 prompts with --quantization fp8
weights and --kv-cache-dtype fp8_e4m3); serve_fp8 (those flags through `radixserve serve`: the
openai client's completions and the 2,000-request bursts: gpu/serve_fp8.py); serve_int4 (the
same with an int4 AWQ checkpoint's dummy weights); serve_gguf (the same as GGUF Q4_K
blocks); extend_rows (a prompt's first token with its extend eager and as decode rows replayed
from the CUDA graphs: gpu/extend_rows.py; extend_rows_prefix the same after a cached prefix);
faults (every
service SIGKILLed mid-load, Redis restarted and hostile input, with the executor on the GPU:
gpu/faults.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SECTIONS = [
    "roofline",
    "correctness",
    "decode1",
    "peer",
    "heavy",
    "structured",
    "offline",
    "offline_fp8",
    "online",
    "profile",
    "prefill",
]
QUANT_SECTION_NAMES = (
    "quant_decode",
    "quant_decode_int4",
    "quant_decode_act_order",
    "quant_decode_batch8",
    "quant_decode_batch8_fp8",
    "quant_decode_batch32",
    "quant_decode_batch64",
    "quant_prefill_int4",
)
# Seconds per section; together they fit one ten-minute command.
TIME_LIMITS = {
    "roofline": 30,
    "correctness": 260,  # seven tiny models, each family's kernel variants compiled
    "decode1": 150,  # a fresh machine: the dummy 8B model, start-up timings and graphs
    "peer": 90,
    "heavy": 60,
    "structured": 180,
    "offline": 300,  # a fresh machine: FlashInfer compiles its kernels on first use (about 100 s)
    "offline_fp8": 230,
    "online": 240,
    "burst": 420,
    "profile": 300,
    "prefill": 240,
    "engine_ab": 300,
    "protocols": 420,
    "dp": 580,
    "observability": 580,
    "tools": 300,
    "tp": 560,
    "tp70b": 580,
    "tp_kill": 400,
    "mla_kernel": 240,
    "moe_kernel": 240,
    "gguf_kernel": 300,
    "w4a16_kernel": 420,
    "w4a16_mma": 420,  # 4 shapes x 7 row counts x (18 launches + the old kernels), cold weights
    "qwen3moe": 480,
    "dsv2lite": 480,
    "scale": 480,
    "qwen3moe_decode": 240,  # the decode half alone (no offline workload)
    "dsv2lite_decode": 240,
    "qwen3moe_batches": 240,  # one engine, three batch sizes
    "qwen3moe_fp8": 480,  # bf16 and the FP8 release's layout, three batch sizes each
    "moe_fp8_tiles": 360,  # the expert launches alone, cold, bf16 / fp8 blocks / fp8 rows
    "dsv2lite_batches": 240,
    # four 8B models, each loaded with dummy weights and graphed (GGUF's blocks drawn on the CPU)
    "quant_decode": 540,
    "quant_decode_int4": 420,  # bf16, int4 AWQ and int4 GPTQ 8B models
    "quant_decode_act_order": 420,  # bf16, int4 GPTQ without and with act-order
    "quant_decode_batch8": 420,  # bf16, int4 AWQ and GGUF Q4_K, 8 requests at once
    "quant_decode_batch8_fp8": 420,  # bf16, fp8 per channel and fp8 blocks, the same
    "quant_decode_batch32": 360,  # bf16 and int4 AWQ, 32 requests at once
    "quant_decode_batch64": 360,  # bf16 and int4 AWQ, 64 requests at once
    "quant_prefill_int4": 420,  # bf16, int4 AWQ and GGUF Q4_K: one 4,096-token prompt each
    "offline_fp8w": 260,
    "flashinfer_kernel": 540,  # FlashInfer compiles its kernels on first use
    "shared_prefix": 540,  # two servers, the workload on each
    "long_prefill": 420,  # one engine, four 100K-token prompts, FlashInfer's chunk kernels
    "shared_decode": 150,
    "serve_fp8": 480,  # --quantization fp8 through `radixserve serve`: openai client, bursts
    "serve_int4": 480,  # an int4 AWQ checkpoint through `radixserve serve`: the same
    "serve_gguf": 480,  # GGUF Q4_K blocks through `radixserve serve`: the same
    "extend_rows": 420,  # first tokens with extends eager against as graphed decode rows
    "extend_rows_prefix": 300,  # the same after a cached prefix (bf16)
    "faults": 580,  # every service killed mid-load, Redis restarted, hostile input (gpu/faults.py)
}
OFFLINE_RUN_S = 130  # the 500-prompt run stops here and reports what it finished


def run_section(name: str, out_dir: Path) -> dict[str, Any]:
    from loadtest.gpu import sections

    if name == "roofline":
        return sections.roofline()
    if name == "correctness":
        return sections.correctness()
    if name == "decode1":
        return sections.decode_batch1(str(out_dir))
    if name == "peer":
        return sections.peer_hf()
    if name == "offline":
        return sections.offline_throughput(time_limit=OFFLINE_RUN_S)
    if name == "offline_fp8":
        return sections.offline_throughput(time_limit=OFFLINE_RUN_S, kv_cache_dtype="fp8_e5m2")
    if name == "structured":
        from loadtest.gpu.structured import structured

        return structured()
    if name == "heavy":
        return sections.decode_heavy_offline()
    if name == "online":
        return sections.online(str(out_dir))
    if name == "burst":
        from loadtest.gpu.burst import burst_section

        return burst_section(str(out_dir))
    if name == "profile":
        from loadtest.gpu.profile import profile_section

        return profile_section()
    if name == "prefill":
        from loadtest.gpu.prefill import prefill_section

        return prefill_section()
    if name == "engine_ab":
        from loadtest.gpu.engine_ab import engine_ab_section

        return engine_ab_section()
    if name == "protocols":
        from loadtest.gpu.protocols import protocols_section

        return protocols_section(str(out_dir))
    if name == "dp":
        from loadtest.gpu.dp import dp_section

        return dp_section(str(out_dir))
    if name == "tools":
        from loadtest.gpu.tools import tools_section

        return tools_section()
    if name == "tp":
        from loadtest.gpu.tp import tp_section

        return tp_section()
    if name == "tp70b":
        from loadtest.gpu.tp_stack import tp70b_section

        return tp70b_section(str(out_dir))
    if name == "tp_kill":
        from loadtest.gpu.tp_stack import tp_kill_section

        return tp_kill_section(str(out_dir))
    if name == "observability":
        from loadtest.gpu.observability import observability_section

        return observability_section(str(out_dir))
    if name == "mla_kernel":
        from loadtest.gpu.mla_kernel import mla_kernel_section

        return mla_kernel_section()
    if name == "moe_kernel":
        from loadtest.gpu.moe import moe_kernel_section

        return moe_kernel_section()
    if name == "gguf_kernel":
        from loadtest.gpu.gguf_kernel import gguf_kernel_section

        return gguf_kernel_section()
    if name == "w4a16_kernel":
        from loadtest.gpu.w4a16 import w4a16_kernel_section

        return w4a16_kernel_section()
    if name == "w4a16_mma":
        from loadtest.gpu.w4a16_mma import w4a16_mma_section

        return w4a16_mma_section()
    if name == "scale":
        from loadtest.gpu.scale import scale_section

        return scale_section()
    if name in ("qwen3moe", "qwen3moe_decode"):
        from loadtest.gpu.moe import qwen3moe_section

        return qwen3moe_section(0 if name.endswith("_decode") else OFFLINE_RUN_S)
    if name in ("dsv2lite", "dsv2lite_decode"):
        from loadtest.gpu.deepseek import dsv2lite_section

        return dsv2lite_section(0 if name.endswith("_decode") else OFFLINE_RUN_S)
    if name == "qwen3moe_batches":
        from loadtest.gpu.moe import qwen3moe_batches_section

        return qwen3moe_batches_section()
    if name == "qwen3moe_fp8":
        from loadtest.gpu.moe import qwen3moe_fp8_section

        return qwen3moe_fp8_section()
    if name == "moe_fp8_tiles":
        from loadtest.gpu.moe_fp8 import moe_fp8_tiles_section

        return moe_fp8_tiles_section()
    if name == "dsv2lite_batches":
        from loadtest.gpu.deepseek import dsv2lite_batches_section

        return dsv2lite_batches_section()
    if name in QUANT_SECTION_NAMES:
        from loadtest.gpu.quant import SECTIONS as QUANT_SECTIONS
        from loadtest.gpu.quant import quant_decode_section

        return quant_decode_section(QUANT_SECTIONS[name])
    if name == "shared_prefix":
        from loadtest.gpu.burst import shared_prefix_section

        return shared_prefix_section(str(out_dir))
    if name == "flashinfer_kernel":
        from loadtest.gpu.flashinfer_attn import flashinfer_kernel_section

        return flashinfer_kernel_section()
    if name == "long_prefill":
        from loadtest.gpu.long_prefill import long_prefill_section

        return long_prefill_section()
    if name == "shared_decode":
        from loadtest.gpu.shared_decode import shared_decode_section

        return shared_decode_section()
    if name == "serve_fp8":
        from loadtest.gpu.serve_fp8 import serve_fp8_section

        return serve_fp8_section(str(out_dir))
    if name == "serve_int4":
        from loadtest.gpu.serve_fp8 import serve_int4_section

        return serve_int4_section(str(out_dir))
    if name == "extend_rows":
        from loadtest.gpu.extend_rows import extend_rows_section

        return extend_rows_section()
    if name == "extend_rows_prefix":
        from loadtest.gpu.extend_rows import extend_rows_prefix_section

        return extend_rows_prefix_section()
    if name == "serve_gguf":
        from loadtest.gpu.serve_fp8 import serve_gguf_section

        return serve_gguf_section(str(out_dir))
    if name == "faults":
        from loadtest.gpu.faults import gpu_faults_section

        return gpu_faults_section(str(out_dir))
    if name == "offline_fp8w":
        return sections.offline_throughput(
            time_limit=OFFLINE_RUN_S, kv_cache_dtype="fp8_e4m3", quantization="fp8"
        )
    extra = ["burst", "engine_ab", "protocols", "dp", "observability", "tools"]
    extra += ["tp", "tp70b", "tp_kill", "mla_kernel", "moe_kernel", "qwen3moe", "dsv2lite"]
    extra += ["qwen3moe_decode", "dsv2lite_decode", "scale", "gguf_kernel", "w4a16_kernel"]
    extra += ["qwen3moe_batches", "dsv2lite_batches", "w4a16_mma", "qwen3moe_fp8", "moe_fp8_tiles"]
    extra += [*QUANT_SECTION_NAMES, "offline_fp8w", "flashinfer_kernel"]
    extra += ["shared_prefix", "long_prefill", "shared_decode", "serve_fp8", "serve_int4"]
    extra += ["serve_gguf", "extend_rows", "extend_rows_prefix", "faults"]
    raise SystemExit(f"unknown section {name!r}; known: {', '.join([*SECTIONS, *extra])}")


def table(results: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []

    def get(*path: str) -> Any:
        node: Any = results
        for p in path:
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node

    roof = get("roofline", "decode_roofline_tok_s")
    gpu = get("roofline", "gpu") or "?"
    d1 = get("decode1", "decode_tok_s")
    if d1 is not None:
        share = f" = {100 * d1 / roof:.0f}% of roofline {roof:.0f}" if roof else ""
        rows.append(("batch-1 decode tok/s (in 128, out 256)", f"{d1:.1f}{share}"))
    busy = get("decode1", "gpu_busy_fraction")
    if busy is not None:
        rows.append(("GPU busy share in decode (bs 8)", f"{100 * busy:.1f}%"))
    off = get("offline", "output_tok_s")
    if off is not None:
        rows.append(("offline 500 prompts output tok/s", f"{off:.0f}"))
    off8 = get("offline_fp8", "output_tok_s")
    if off8 is not None:
        vs = f" = {off8 / off:.2f}x bf16 KV" if off else ""
        pool = f", pool {get('offline_fp8', 'kv_pool_tokens')} tokens"
        rows.append(("offline 500 prompts output tok/s, fp8_e5m2 KV", f"{off8:.0f}{vs}{pool}"))
    ttft = get("online", "latency_1rps", "median_ttft_ms")
    itl = get("online", "latency_1rps", "median_itl_ms")
    if ttft is not None:
        rows.append(("online 1 req/s median TTFT / ITL (ms)", f"{ttft:.1f} / {itl:.2f}"))
    peer = get("peer", "speedup")
    if peer is not None:
        rows.append(
            (
                "vs HF generate bs32 in512 out256",
                f"{get('peer', 'radixserve_output_tok_s'):.0f} vs "
                f"{get('peer', 'hf_output_tok_s'):.0f} tok/s = {peer:.1f}x",
            )
        )
    heavy_in = get("heavy", "output_tok_s")
    heavy_bus = get("online", "decode_heavy", "output_throughput")
    if heavy_in is not None and heavy_bus is not None:
        rows.append(
            ("decode-heavy tok/s in-process vs services", f"{heavy_in:.0f} vs {heavy_bus:.0f}")
        )
        t_in, t_bus = (
            get("heavy", "ttft_ms_median"),
            get("online", "decode_heavy", "median_ttft_ms"),
        )
        rows.append(
            ("decode-heavy median TTFT in-process vs services (ms)", f"{t_in:.1f} vs {t_bus:.1f}")
        )
    cvu = get("structured", "constrained_vs_unconstrained", "ratio")
    if cvu is not None:
        rows.append(("JSON-constrained / unconstrained tok/s (bs 64)", f"{100 * cvu:.0f}%"))
        cj = get("structured", "constrained_vs_unconstrained", "ratio_jump_forward")
        if cj is not None:
            rows.append(("same, with jump-forward (the default)", f"{100 * cj:.0f}%"))
        jf = get("structured", "jump_forward")
        rows.append(
            (
                "jump-forward speed-up (long fixed keys, bs 64)",
                f"{jf['speedup']:.2f}x ({jf['plain_steps']} -> {jf['jump_steps']} steps)",
            )
        )
    for name, label in (("burst_2000", "no retry"), ("burst_2000_retry", "retrying")):
        b = get("burst", name)
        if b is not None:
            c = b["counts"]
            rows.append(
                (
                    f"2,000 at once, {label}: 2xx / refused / lost",
                    f"{c.get('2xx', 0)} / {b['refusals']} "
                    f"({b['refusals_without_retry_after']} w/o Retry-After) / {b['lost']}",
                )
            )
    gsp = get("burst", "shared_prefix_256")
    if gsp is not None:
        rows.append(
            (
                "shared prefix at 256: completed / lost",
                f"{gsp['completed']}/{gsp['requests']} / {gsp['lost']}",
            )
        )
    dp_runs = get("dp", "runs") or {}
    gpus = "two GPUs" if (get("dp", "gpus") or 1) >= 2 else "one GPU"
    for run in ("cache_aware", "round_robin", "single"):
        r = dp_runs.get(run)
        if r is not None:
            hit = r["cache_hit_rate"]
            where = "one executor, one GPU" if run == "single" else f"DP=2 on {gpus}, {run}"
            rows.append(
                (
                    f"shared prefix 64x16 at once: {where}",
                    f"{'n/a' if hit is None else f'{100 * hit:.1f}%'} cache hits, "
                    f"{r['output_throughput']:.0f} output tok/s, {r['completed']} done",
                )
            )
            if r.get("services"):
                from loadtest.stack_scrape import summary

                rows.append((f"  where {run}'s time went", summary(r["services"])))
    for arch in ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "deepseek_v2"):
        c = get("correctness", arch)
        if c is not None:
            rows.append(
                (
                    f"greedy vs HF bf16 ({arch})",
                    f"{c['identical_64_tokens']}/{c['prompts']} identical, "
                    f"graph==eager {c['graph_equals_eager']}, flips {c['flips']}",
                )
            )
    for point in get("mla_kernel", "points") or []:
        rows.append(
            (
                f"MLA decode bs {point['bs']}, {point['context']} keys: latent TB/s",
                f"{point['backend_TBps']:.2f} = {100 * point['backend_of_copy']:.0f}% of copy"
                + (f" (best {point['best_TBps']:.2f})" if "best_TBps" in point else ""),
            )
        )
    for tokens, r in (get("moe_kernel", "tokens") or {}).items():
        rows.append(
            (
                f"fused MoE vs torch loop, {tokens} tokens (Qwen3-30B-A3B)",
                f"{r['fused_ms']:.3f} ms (graph {r['fused_graph_ms']:.3f}) vs "
                f"{r['torch_loop_ms']:.3f} ms = {r['speedup']:.1f}x",
            )
        )
    for arch, c in (get("moe_kernel", "correctness") or {}).items():
        rows.append(
            (
                f"greedy vs HF bf16 ({arch})",
                f"{c['identical_64_tokens']}/{c['prompts']} identical, "
                f"graph==eager {c['graph_equals_eager']}, flips {c['flips']}",
            )
        )
    for key, label in (("qwen3moe", "Qwen3-30B-A3B"), ("dsv2lite", "DeepSeek-V2-Lite")):
        share = get(key, "decode_share_of_roofline")
        if share is not None:
            rows.append(
                (
                    f"{label} batch-1 decode tok/s",
                    f"{get(key, 'decode1', 'decode_tok_s'):.1f} = {100 * share:.0f}% of "
                    f"roofline {get(key, 'decode_roofline_tok_s'):.0f} (target 70%)",
                )
            )
        off = get(key, "offline", "output_tok_s")
        if off is not None:
            rows.append((f"{label} offline 500 prompts output tok/s", f"{off:.0f}"))
        if results.get(f"{key}_batches"):
            from loadtest.gpu.moe import batch_rows

            rows += batch_rows(label, results[f"{key}_batches"])
    if results.get("qwen3moe_fp8"):
        from loadtest.gpu.moe import fp8_rows

        rows += fp8_rows(results["qwen3moe_fp8"])
    if results.get("moe_fp8_tiles"):
        from loadtest.gpu.moe_fp8 import table_rows as moe_fp8_rows

        rows += moe_fp8_rows(results["moe_fp8_tiles"])
    if results.get("scale"):
        from loadtest.gpu.scale import table_rows

        rows += table_rows(results["scale"])
    if results.get("gguf_kernel"):
        from loadtest.gpu.gguf_kernel import table_rows as gguf_rows

        rows += gguf_rows(results["gguf_kernel"])
    if results.get("w4a16_kernel"):
        from loadtest.gpu.w4a16 import table_rows as w4a16_rows

        rows += w4a16_rows(results["w4a16_kernel"])
    if results.get("w4a16_mma"):
        from loadtest.gpu.w4a16_mma import table_rows as mma_rows

        rows += mma_rows(results["w4a16_mma"])
    for section in QUANT_SECTION_NAMES:
        if results.get(section):
            from loadtest.gpu.quant import table_rows as quant_rows

            rows += quant_rows(results[section], prefill=section.startswith("quant_prefill"))
    w8 = get("offline_fp8w", "output_tok_s")
    if w8 is not None:
        rows.append(("offline 500 prompts output tok/s, fp8 weights + fp8_e4m3 KV", f"{w8:.0f}"))
    width = max((len(k) for k, _ in rows), default=10)
    lines = [f"GPU: {gpu}"] + [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.gpu_bench", description=__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one in this process
    a = p.parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.section:
        result = run_section(a.section, out_dir)
        (out_dir / f"section_{a.section}.json").write_text(json.dumps(result, indent=1))
        return
    results_path = out_dir / "gpu_bench.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}
    for name in a.sections.split(","):
        t0 = time.monotonic()
        log = out_dir / f"section_{name}.log"
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "loadtest.gpu_bench",
                    "--section",
                    name,
                    "--out",
                    str(out_dir),
                ],
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                timeout=TIME_LIMITS[name],
            )
            section_file = out_dir / f"section_{name}.json"
            if proc.returncode == 0 and section_file.exists():
                results[name] = json.loads(section_file.read_text())
            else:
                results[name] = {
                    "error": f"exit {proc.returncode}",
                    "log_tail": log.read_text(errors="replace")[-2000:],
                }
        except subprocess.TimeoutExpired:
            results[name] = {
                "error": f"timed out after {TIME_LIMITS[name]}s",
                "log_tail": log.read_text(errors="replace")[-2000:],
            }
        results[name]["section_s"] = time.monotonic() - t0
        results_path.write_text(json.dumps(results, indent=1))
        print(
            f"[{name}] {time.monotonic() - t0:.0f}s "
            f"{'ERROR ' + results[name]['error'] if 'error' in results[name] else 'ok'}",
            flush=True,
        )
    print(table(results))


if __name__ == "__main__":
    main()
