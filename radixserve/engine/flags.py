"""The Engine's keyword arguments are the executor's command-line flags (`max_total_tokens=
4096` is `--max-total-tokens 4096`), checked by the same parser, so an embedded engine takes
and refuses exactly what `radixserve serve` does."""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

from services.executor.main import parse_args


def engine_args(model: str | None, overrides: dict[str, Any]) -> argparse.Namespace:
    """The flags, parsed; ValueError with the parser's message for a bad one."""
    argv = engine_argv(model, overrides)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_args(argv)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        message = lines[-1] if lines else f"invalid engine arguments: {overrides}"
        raise ValueError(message.replace("radixserve executor: error: ", "")) from None


def engine_argv(model: str | None, overrides: dict[str, Any]) -> list[str]:
    """The command line these keyword arguments stand for (the ranks of a tensor-parallel
    engine are started with it)."""
    argv: list[str] = []
    if model is not None:
        argv += ["--model", str(model)]
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        else:
            argv += [flag, str(value)]
    return argv
