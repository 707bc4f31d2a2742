"""The serving benchmark's flags; names and defaults follow SGLang's bench_serving."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from loadtest.backends import BACKENDS

DATASETS = ["random", "generated-shared-prefix", "multi-turn", "json", "jsonl"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _add_datasets(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("datasets")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="the JSONL file of --dataset-name jsonl")
    g.add_argument(
        "--num-prompts",
        type=int,
        default=1000,
        help="requests of random, json and jsonl (jsonl: <= 0 takes every line)",
    )
    g.add_argument("--random-input-len", type=_positive_int, default=1024)
    g.add_argument("--random-output-len", type=_positive_int, default=1024)
    g.add_argument(
        "--random-range-ratio",
        type=_ratio,
        default=0.0,
        help="lengths are drawn uniformly from [len * ratio, len] (random and json)",
    )
    g.add_argument("--gsp-num-groups", type=_positive_int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=_positive_int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=_positive_int, default=2048)
    g.add_argument("--gsp-question-len", type=_positive_int, default=128)
    g.add_argument("--gsp-output-len", type=_positive_int, default=256)
    g.add_argument("--multi-turn-num-conversations", type=_positive_int, default=32)
    g.add_argument("--multi-turn-num-turns", type=_positive_int, default=4)
    g.add_argument(
        "--multi-turn-input-len",
        type=_positive_int,
        default=256,
        help="tokens of each turn's new user message",
    )
    g.add_argument("--multi-turn-output-len", type=_positive_int, default=128)
    g.add_argument(
        "--jsonl-output-len", type=_positive_int, default=256,
        help="the output length of a JSONL line without output_len",
    )  # fmt: skip


def _add_traffic(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traffic")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals; inf sends all at once (multi-turn: "
        "conversations per second, each turn sent when the previous answer arrived)",
    )
    g.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=None,
        help="at most this many requests in flight",
    )
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="requests sent and awaited first, not counted",
    )
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--request-timeout", type=float, default=6 * 3600,
                   help="seconds one request may take")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.serving",
        description="Benchmark an LLM server's online serving: throughput, TTFT, ITL, TPOT.",
    )
    p.add_argument(
        "--backend",
        choices=sorted([*BACKENDS, "grpc", "grpc-smg"]),
        default="radixserve",
        help="grpc: radixserve.v1.RadixServe's StreamGenerate; grpc-smg: SMG's SGLang worker "
        "protocol (token ids in and out); both need --grpc-target",
    )
    p.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (default: --host, --port)")
    p.add_argument(
        "--grpc-target",
        help="host:port of the gRPC server, for --backend grpc and grpc-smg (the tokenizer "
        "and model name still come from --base-url unless --tokenizer is given)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="the model name to send (default: GET /v1/models)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", ""),
        help="sent as Authorization: Bearer (default: $OPENAI_API_KEY; none when empty)",
    )
    p.add_argument(
        "--tokenizer",
        help="an HF directory or name, a tokenizer.json, a .gguf file, or 'default' (the GGUF "
        "of radixserve's default model); default: the server's GET /get_model_info",
    )
    _add_datasets(p)
    _add_traffic(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--disable-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that refuse it; outputs may then be shorter)",
    )
    p.add_argument(
        "--extra-request-body", type=_json_object, default={},
        help="a JSON object merged into every request body",
    )  # fmt: skip
    p.add_argument(
        "--hop-latency", action="store_true",
        help="radixserve backend: ask /generate where each request's first token spent its "
        "time (meta_info.hop_latency_ms) and print the per-stage medians",
    )  # fmt: skip
    p.add_argument("--output-file", help="append the run's metrics and config as a JSON line")
    p.add_argument("--plot-dir", help="write latency CDF and throughput PNGs here (matplotlib)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")  # fmt: skip
    return p
