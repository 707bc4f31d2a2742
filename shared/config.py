"""Flags with environment-variable twins, validated when a service starts.

Every flag `--foo-bar` can also be set as `RADIXSERVE_FOO_BAR` (the flag wins). Validation
failures exit with argparse's usage message naming the flag, before any work starts.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable
from typing import Any

from shared import constants


def env_name(flag: str) -> str:
    return "RADIXSERVE_" + flag.lstrip("-").replace("-", "_").upper()


class EnvArgumentParser(argparse.ArgumentParser):
    """argparse whose defaults come from RADIXSERVE_* variables and whose help names them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checks: list[tuple[str, Callable[[Any], str | None]]] = []

    def add_flag(
        self,
        flag: str,
        *,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str = "",
        env: str | None = None,
        choices: list[Any] | None = None,
        check: Callable[[Any], str | None] | None = None,
        nargs: str | None = None,
    ) -> None:
        """Add `flag`; `check(value)` returns an error message or None. With `nargs` ("+")
        the flag takes several values, and its variable a comma- or space-separated list."""
        var = env or env_name(flag)
        raw = os.environ.get(var)
        value = default
        if raw is not None and raw != "":
            try:
                value = [type(v) for v in raw.replace(",", " ").split()] if nargs else type(raw)
            except (TypeError, ValueError) as e:
                self.error(f"environment variable {var}={raw!r} is invalid for {flag}: {e}")
            # argparse checks choices only for values given on the command line.
            if choices is not None and value not in choices:
                self.error(
                    f"environment variable {var}={raw!r} is invalid for {flag}: choose from "
                    + ", ".join(map(str, choices))
                )
        self.add_argument(
            flag,
            type=type,
            default=value,
            choices=choices,
            nargs=nargs,
            help=f"{help} [env {var}; default {default!r}]",
        )
        if check is not None:
            self._checks.append((flag, check))

    def add_bool(
        self, flag: str, *, help: str = "", env: str | None = None, default: bool = False
    ) -> None:
        var = env or env_name(flag)
        raw = os.environ.get(var, "").strip().lower()
        if raw not in ("", "0", "1", "true", "false", "yes", "no"):
            self.error(f"environment variable {var}={raw!r} must be true or false")
        self.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=raw in ("1", "true", "yes") if raw else default,
            help=f"{help} [env {var}]",
        )

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        ns = super().parse_args(args, namespace)
        for flag, check in self._checks:
            value = getattr(ns, flag.lstrip("-").replace("-", "_"))
            if value is None:
                continue
            problem = check(value)
            if problem:
                self.error(f"{flag}={value!r}: {problem}")
        return ns


def positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def increasing(values: list[float]) -> str | None:
    """Histogram bucket boundaries: positive, strictly increasing."""
    if not values or values[0] <= 0 or any(b <= a for a, b in itertools.pairwise(values)):
        return "give positive boundaries in increasing order"
    return None


def fraction(value: float) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def add_common_flags(p: EnvArgumentParser) -> None:
    """Flags every service takes."""
    p.add_flag(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        env="REDIS_URL",
        help="Redis server the services talk through",
    )
    p.add_flag(
        "--redis-max-connections",
        type=int,
        default=64,
        check=positive,
        help="Redis connections this process shares (more concurrent commands wait for one); "
        "each stream reader also has one of its own",
    )
    p.add_flag("--instance-id", default="", help="this instance's name (default: host-pid)")
    p.add_flag(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )
    p.add_flag(
        "--model",
        default="",
        help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_flag(
        "--served-model-name", default="", help="model name in the API (default: from --model)"
    )
    p.add_flag(
        "--grammar-cache-ttl",
        type=float,
        default=constants.GRAMMAR_CACHE_TTL_S,
        check=positive,
        help="seconds a compiled grammar stays in Redis after its last use (grammar service "
        "and executors)",
    )
    add_observability_flags(p)
    p.add_bool(
        "--is-embedding",
        help="serve the model as an embedding model: POST /v1/embeddings, and a 400 for the "
        "generation endpoints (gateway and executors)",
    )
    p.add_flag(
        "--embedding-pooling",
        default="auto",
        choices=["auto", "last", "mean"],
        help="with --is-embedding: pool by the last token or the mean of the tokens (auto: "
        "what the checkpoint's sentence-transformers Pooling module declares, else last)",
    )
    p.add_flag(
        "--detokenizer-partitions",
        type=int,
        default=1,
        check=positive,
        help="number of detokenizer partitions (requests are hashed onto them)",
    )


def add_observability_flags(p: EnvArgumentParser) -> None:
    """Metrics and tracing: every service takes them (README, "Monitoring")."""
    p.add_bool(
        "--enable-metrics",
        default=True,
        help="collect Prometheus metrics (the gateway serves them at /metrics on its API port; "
        "every service on --metrics-port)",
    )
    p.add_flag(
        "--metrics-port",
        type=int,
        default=0,
        check=non_negative,
        help="serve /metrics and /health on this port (0: none). `radixserve serve` gives its "
        "children this port and the next ones, in start order",
    )
    p.add_flag("--metrics-host", default="0.0.0.0", help="address --metrics-port listens on")
    p.add_flag(
        "--otlp-traces-endpoint",
        default="",
        help="send OpenTelemetry spans here, one trace per request (e.g. "
        "http://otel-collector:4318, or host:4317 with --otlp-traces-protocol grpc); empty: off",
    )
    p.add_flag(
        "--otlp-traces-protocol",
        default="http/protobuf",
        choices=["http/protobuf", "grpc"],
        help="OTLP transport of --otlp-traces-endpoint",
    )
