"""The grammar service's flags, which `radixserve serve` takes too: importable without
xgrammar (and the torch and transformers it imports)."""

from __future__ import annotations

from shared.config import EnvArgumentParser, positive

DEFAULT_COMPILE_TIMEOUT_S = 10.0


def add_flags(p: EnvArgumentParser) -> None:
    """The grammar service's own flags (`radixserve serve` takes them too)."""
    p.add_flag(
        "--grammar-threads", type=int, default=2, check=positive, help="grammar compile threads"
    )
    p.add_flag(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        check=positive,
        help="seconds a grammar may take to compile once a thread takes it; a slower one is "
        "refused with a 400 for a minute",
    )
