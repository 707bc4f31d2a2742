"""The `extend_rows` section: a prompt's time to its first token when its extend step runs
eagerly (`rows_max = 0`, as before) against as decode rows replayed from the CUDA graphs
(services/executor/extend_rows.py: up to MAX_ROWS new tokens by default; "rows_256" was the
wider setting that set MAX_ROWS to 256, from 64), Llama-3.1-8B's shapes with dummy weights,
per weight format, all in one process.

Per prompt length: "cold", a new prompt (every token computed), and "cached", the same prompt
again (the radix cache holds all of it but the last token, which is computed). Each figure is
the median of REPS requests of one prompt at a time (`loadtest.offline.run_latency`: from
submission to the first token).
"""

from __future__ import annotations

import gc
import statistics
from typing import Any

import torch

from loadtest import offline
from loadtest.gpu.quant import FORMATS, model_dir

PROMPT_LENS = (32, 64, 256)
SETTINGS = {"extend": 0, "rows": None, "rows_256": 256}  # ModelRunner.rows_max
REPS = 3
FORMAT_NAMES = ("bf16", "fp8_channel", "int4_awq", "gguf_q4_k")


def _first_token_ms(engine: Any, args: Any, seed: int) -> float:
    args.seed = seed
    return 1000 * offline.run_latency(engine, args)["prefill_s"]


def _one_format(name: str) -> dict[str, Any]:
    fmt = FORMATS[name]
    model = model_dir(fmt)
    args = offline.parse_args(
        [
            *("latency", "--model", str(model), "--load-format", "dummy"),
            *("--batch-size", "1", "--input-len", "32", "--output-len", "2"),
            *("--max-total-tokens", "40000", *fmt.flags),
        ]
    )
    engine = offline.make_engine(args)
    out: dict[str, Any] = {}
    seed = 1000
    for setting, rows_max in SETTINGS.items():
        engine.runner.rows_max = rows_max
        for n in PROMPT_LENS:
            args.input_len = n
            cold, cached = [], []
            for _ in range(REPS):
                seed += 1
                cold.append(_first_token_ms(engine, args, seed))  # its warm-up is new too
                cached.append(_first_token_ms(engine, args, seed))
            out[f"{setting} {n}"] = {
                "cold_ms": round(statistics.median(cold), 2),
                "cached_ms": round(statistics.median(cached), 2),
            }
            print(f"{name} {setting} {n}: {out[f'{setting} {n}']}", flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def extend_rows_section() -> dict[str, Any]:
    return {
        "gpu": torch.cuda.get_device_name(),
        "formats": {name: _one_format(name) for name in FORMAT_NAMES},
    }
