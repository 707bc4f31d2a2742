"""Kernel tests run natively on a CUDA device, else in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported (it decides at `@triton.jit` time), so
this module sets it before anything below it imports a kernel. Tests marked `gpu` (the larger
shapes, and dtypes the interpreter gets wrong) are skipped without CUDA.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch


def _reimport_for_the_interpreter() -> None:
    """Triton was imported before this file ran (torch._dynamo imports it, e.g. through
    transformers, when another test directory is collected first), so its own @jit helpers
    (tl.sum, tl.cdiv...) and any kernel module imported already were built for a GPU: run
    those modules again, in place, now that TRITON_INTERPRET is set. Setting TRITON_INTERPRET
    before the session starts (or in tests/conftest.py) makes this unnecessary."""
    from triton.runtime.interpreter import InterpretedFunction

    for name in ("triton.language.standard", "triton.language.random", "triton.language"):
        importlib.reload(sys.modules[name])
    for name in sorted(n for n in sys.modules if n.startswith("kernels.")):
        importlib.reload(sys.modules[name])
    if not isinstance(sys.modules["triton.language"].sum, InterpretedFunction):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set and could not be switched to "
            "the interpreter: set TRITON_INTERPRET=1 in the environment or in tests/conftest.py"
        )


HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        _reimport_for_the_interpreter()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
