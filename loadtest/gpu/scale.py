"""The `scale` section: decode at long contexts and big batches against its roofline (issue 26).

Each row sends `prompts` prompts of exactly `input` tokens at once, 512 output tokens each,
through the overlapped offline loop (`loadtest.offline throughput`, --max-prefill-tokens
16384) on Llama-3.1-8B's shapes (dummy weights, bf16), one engine for every row. A decode
step's roofline reads the weights once and every running request's KV cache: (weights + the
KV of the mean context over the decode, 128 KiB a token) / the copy bandwidth measured in the
same run. A row's decode step is the mean over the decode steps that follow a decode step
(the overlapped loop charges a decode step interleaved with prefill chunks the chunk's time);
the mean over every decode step is kept beside it. Printed as the issue's table, with the
100,000-token prompt's prefill time and the host's time per step at the largest batch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from loadtest import offline
from loadtest.gpu.bandwidth import copy_bandwidth
from loadtest.gpu.dp import kv_bytes_per_token
from loadtest.gpu.hosttime import HostTimes
from loadtest.gpu.models import LLAMA_3_1_8B, llama8b_dir, weight_bytes

OUTPUT = 512
# (prompts, input tokens): the rows; the largest batch last, where host time is read
ROWS = ((1, 1_000), (1, 32_000), (1, 100_000), (8, 16_000), (64, 2_000), (256, 512))
TARGET_SHARE = 0.75


def row_args(model: Path, prompts: int, input_len: int) -> Any:
    # a seed of its own per row: with one seed each row's prompt would begin with the last
    # row's, and the radix cache would serve part of the prefill measured
    seed = ROWS.index((prompts, input_len)) + 1 if (prompts, input_len) in ROWS else 0
    return offline.parse_args(
        [
            *("throughput", "--model", str(model), "--load-format", "dummy"),
            *("--num-prompts", str(prompts), "--input-len", str(input_len), "--seed", str(seed)),
            *("--output-len", str(OUTPUT), "--range-ratio", "1.0"),
            *("--max-prefill-tokens", "16384", "--max-running-requests", "256"),
        ]
    )


def roofline_ms(prompts: int, input_len: int, bw: float) -> float:
    """Milliseconds a decode step needs at the copy bandwidth: the weights, and the KV of
    every request at its mean context over the decode (input + half the output)."""
    kv = prompts * (input_len + OUTPUT / 2) * kv_bytes_per_token(LLAMA_3_1_8B)
    return 1000 * (weight_bytes(LLAMA_3_1_8B) + kv) / bw


def scale_section() -> dict[str, Any]:
    bw = copy_bandwidth()
    model = llama8b_dir(Path(tempfile.mkdtemp()))
    engine = offline.make_engine(row_args(model, *ROWS[0]))
    rows = []
    for prompts, input_len in ROWS:
        host = HostTimes(engine) if (prompts, input_len) == ROWS[-1] else None
        run = offline.run_throughput(engine, row_args(model, prompts, input_len))
        # steady decode steps only: a decode step just after a prefill chunk is charged that
        # chunk's device time by the overlapped loop (8 x 16,000: 7 steps of ~550 ms, 3.7 s
        # that made the row's mean step 19.8 ms against a steady 12.4)
        step_ms = 1000 * run["steady_decode_s"] / max(1, run["steady_decode_steps"])
        floor = roofline_ms(prompts, input_len, bw)
        row = {
            "prompts": prompts,
            "input": input_len,
            "decode_ms_per_step": step_ms,
            "decode_ms_per_step_all": 1000 * run["decode_s"] / max(1, run["decode_steps"]),
            "roofline_ms_per_step": floor,
            "share": floor / step_ms,
            "output_tok_s": run["output_tok_s"],
            "prefill_s": run["extend_s"],
            # all prompts arrive at once: for one prompt, its time to the first token
            "ttft_s_median": run["ttft_ms_median"] / 1000,
            "decode_batch_mean": run["decode_batch_mean"],
            "finished": run["finished"],
        }
        if host is not None:
            row["host_ms_per_step"] = host.per_step()  # the mean over every step, prefill's too
            row["host_ms_per_decode_step"] = host.medians()  # issue 26's figure: median, DECODE
        print(f"scale {prompts} x {input_len}: {row}", flush=True)
        rows.append(row)
    return {
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth_TBps": bw / 1e12,
        "kv_pool_tokens": engine.policy.kv.num_slots,
        "target_share": TARGET_SHARE,
        "rows": rows,
    }


def table_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The issue's table, one line per row, for gpu_bench's printout."""
    out = []
    for r in result.get("rows", []):
        out.append(
            (
                f"scale {r['prompts']} x {r['input']:,}: decode ms/step",
                f"{r['decode_ms_per_step']:.2f} vs roofline {r['roofline_ms_per_step']:.2f} = "
                f"{100 * r['share']:.0f}% (target 75%), {r['output_tok_s']:.0f} out tok/s, "
                f"prefill {r['prefill_s']:.2f} s",
            )
        )
    return out
