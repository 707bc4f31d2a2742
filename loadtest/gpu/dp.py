"""The `dp` section: data parallelism. `radixserve serve --dp-size 2` runs two executors, one
per GPU where the machine has two (issue 25, run 3), else both on the one card: Llama-3.1-8B's
shapes with dummy weights (the word tokenizer), and the generated-shared-prefix workload (64
groups x 16 prompts, a 2,048-token system prompt and a 128-token question each, 256 output
tokens, all sent at once) goes through it once routed cache_aware and once round_robin; then
through one executor with a whole card, for reference. Cache hit rate and throughput of each
(loadtest/dp_bench.py does the runs).

On one card, each DP executor gets half of what the card holds for pools: the share one
executor takes by default (--mem-fraction-static 0.85), less both copies of the weights, split
in two with --max-total-tokens (--mem-fraction-static cannot split a card: each executor would
size its pool from what is free when it looks). The rest of the card is both executors'
activations, CUDA graphs and contexts.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from loadtest import dp_bench
from loadtest.gpu.models import LLAMA_3_1_8B, llama8b_dir, weight_bytes

DP_SIZE = 2
GATEWAYS = 4
CARD_SHARE = 0.85  # of the card's memory for weights and KV pools, all executors together
WORKLOAD = {
    "--gsp-num-groups": 64,
    "--gsp-prompts-per-group": 16,
    "--gsp-system-prompt-len": 2048,
    "--gsp-question-len": 128,
    "--gsp-output-len": 256,
}


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token (bf16)."""
    heads, dim = config["num_key_value_heads"], config["head_dim"]
    return 2 * config["num_hidden_layers"] * heads * dim * dtype_bytes


def resident_weight_bytes(config: dict[str, Any]) -> int:
    """bf16 bytes the weights take in memory: what a decode step reads, plus the embedding
    table (of which a step reads one row per token)."""
    return weight_bytes(config) + 2 * config["vocab_size"] * config["hidden_size"]


def pool_tokens_each(card_bytes: int, executors: int, config: dict[str, Any]) -> int:
    """KV tokens for each of `executors` sharing a card of `card_bytes`."""
    budget = card_bytes * CARD_SHARE - executors * resident_weight_bytes(config)
    if budget <= 0:
        share = f"{CARD_SHARE:.0%}"
        raise ValueError(f"{executors} copies of the weights do not fit {share} of the card")
    return int(budget // executors // kv_bytes_per_token(config))


def bench_args(model: Path, pool_each: int, out_dir: Path) -> argparse.Namespace:
    argv = ["--model", str(model), "--dp-size", str(DP_SIZE), "--methods", "cache_aware"]
    argv += ["--dp-max-total-tokens", str(pool_each), "--log-dir", str(out_dir)]
    argv += ["--out", str(out_dir / "dp_runs.json")]
    for flag, value in WORKLOAD.items():
        argv += [flag, str(value)]
    # Every run, one executor or two, behind the same GATEWAYS gateways: one gateway process
    # saturates its core relaying two executors' tokens (20K a second over 512 streams).
    serve = ["--load-format", "dummy", "--gateway-replicas", str(GATEWAYS)]
    return dp_bench.build_parser().parse_args([*argv, "--", *serve])


def runs(a: argparse.Namespace) -> list[dp_bench.Run]:
    """cache_aware and round_robin first (what the section is for), one executor last."""
    dp = dp_bench.plan(
        a.dp_size, ["cache_aware", "round_robin"], a.serve_args, a.dp_max_total_tokens, False
    )
    return [*dp, dp_bench.Run("single", list(a.serve_args))]


def dp_section(out_dir: str) -> dict[str, Any]:
    import torch

    _, card = torch.cuda.mem_get_info()
    model = llama8b_dir(Path(tempfile.mkdtemp()), tokenizer="words")
    # With a GPU each, every executor sizes its own pool as one executor alone would.
    own_gpus = torch.cuda.device_count() >= DP_SIZE
    pool = 0 if own_gpus else pool_tokens_each(card, DP_SIZE, LLAMA_3_1_8B)
    a = bench_args(model, pool, Path(out_dir))
    results = dp_bench.run_all(a, runs(a))
    print(dp_bench.table(results), flush=True)
    return {
        "gpu": torch.cuda.get_device_name(),
        "gpus": torch.cuda.device_count(),
        "dp_size": DP_SIZE,
        "pool_tokens_each": pool,
        "workload": {k.removeprefix("--gsp-"): v for k, v in WORKLOAD.items()},
        "runs": {r["run"]: r for r in results},
    }
