"""The `extend_rows` section: a prompt's time to its first token when its extend step runs
eagerly (`rows_max = 0`, as before) against as decode rows replayed from the CUDA graphs
(services/executor/extend_rows.py: up to MAX_ROWS new tokens by default; "rows_256" was the
wider setting that set MAX_ROWS to 256, from 64), Llama-3.1-8B's shapes with dummy weights,
per weight format, all in one process.

`extend_rows_prefix`: bf16 only, a prompt of `new` tokens after a cached prefix of `prefix`
(a turn of a conversation), eager against as rows with no bound on the keys the rows re-read.

Per prompt length: "cold", a new prompt (every token computed), and "cached", the same prompt
again (the radix cache holds all of it but the last token, which is computed). Each figure is
the median of REPS requests of one prompt at a time (`loadtest.offline.run_latency`: from
submission to the first token).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any

import torch

from loadtest import offline
from loadtest.gpu.quant import FORMATS, model_dir
from loadtest.offline_prompts import random_ids
from services.executor import extend_rows

PROMPT_LENS = (32, 64, 256)
SETTINGS = {"extend": 0, "rows": None, "rows_256": 256}  # ModelRunner.rows_max
REPS = 3
FORMAT_NAMES = ("bf16", "fp8_channel", "int4_awq", "gguf_q4_k")
# (cached prefix, new tokens): turns of a conversation
PREFIX_CASES = ((1024, 16), (1024, 64), (1024, 256), (4096, 16), (4096, 64), (4096, 256),
                (16384, 16), (16384, 64), (16384, 256))  # fmt: skip


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


def _after_prefix_ms(engine: Any, prefix: int, new: int, seed: int) -> float:
    """First-token ms of a prompt whose first `prefix` tokens the radix cache holds (a request
    of that prefix alone ran first) and whose last `new` tokens are computed."""
    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    head = random_ids(rng, prefix, vocab)
    offline.drain(engine, [offline.request(f"p{seed}", head, 1)])
    offline.sync(engine)
    start = time.perf_counter()
    d = offline.drain(engine, [offline.request(f"q{seed}", head + random_ids(rng, new, vocab), 2)])
    return 1000 * (d.first_token_at[f"q{seed}"] - start)


def _after_prefix() -> dict[str, Any]:
    """bf16: a turn of a conversation, `new` tokens after a cached `prefix`, eager against as
    rows with no bound on the keys they re-read (what EXTRA_KEYS is set from)."""
    model = model_dir(FORMATS["bf16"])
    args = offline.parse_args(
        [
            *("latency", "--model", str(model), "--load-format", "dummy"),
            *("--max-total-tokens", "120000", "--max-prefill-tokens", "16384"),
        ]
    )
    engine = offline.make_engine(args)
    out: dict[str, Any] = {}
    bound = extend_rows.EXTRA_KEYS
    seed = 5000
    try:
        for setting, rows_max, keys in (("extend", 0, bound), ("rows", 256, 2**40)):
            engine.runner.rows_max = rows_max
            extend_rows.EXTRA_KEYS = keys
            for prefix, new in PREFIX_CASES:
                times = []
                for _ in range(REPS + 1):  # the first compiles what this length needs
                    seed += 1
                    times.append(_after_prefix_ms(engine, prefix, new, seed))
                key = f"{setting} prefix {prefix} new {new}"
                out[key] = round(statistics.median(times[1:]), 2)
                print(f"after a prefix: {key}: {out[key]} ms", flush=True)
    finally:
        extend_rows.EXTRA_KEYS = bound
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def extend_rows_section() -> dict[str, Any]:
    return {
        "gpu": torch.cuda.get_device_name(),
        "formats": {name: _one_format(name) for name in FORMAT_NAMES},
    }


def extend_rows_prefix_section() -> dict[str, Any]:
    return {"gpu": torch.cuda.get_device_name(), "bf16_after_prefix": _after_prefix()}
