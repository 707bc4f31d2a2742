"""Kernel tests run natively on a CUDA device, else in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported (it decides at `@triton.jit` time), so
this module sets it before anything below it imports a kernel. Tests marked `gpu` (the larger
shapes, and dtypes the interpreter gets wrong) are skipped without CUDA.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

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


def _patch_lang_once_per_launch() -> None:
    """The interpreter re-patches triton.language at every call of a @jit helper (tl.sum and
    tl.cdiv are helpers too) through `inspect.getmembers` over its modules: over two thirds
    of an interpreted kernel's time, for patches the launch around the call has made already.
    A helper's call now patches only the modules the launch has not; each launch still
    patches on entry and restores everything on exit, so what runs is unchanged."""
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    langs_of: dict[object, frozenset[int]] = {}
    patched: set[int] = set()  # ids of the modules the launch in progress has patched
    nested: list[Any] = []  # scopes of helpers that patched more, restored with the launch

    def langs(fn: Any) -> frozenset[int]:
        if fn not in langs_of:
            mods = (interpreter.tl, interpreter.tl.core)
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v in mods)
        return langs_of[fn]

    class LaunchScope:
        def __init__(self, scope: Any) -> None:
            self.scope = scope

        def restore(self) -> None:
            while nested:
                nested.pop().restore()
            patched.clear()
            self.scope.restore()

    def once(fn: Any) -> Any:
        need = langs(fn)
        if not patched:  # a launch: GridExecutor restores what this returns
            scope = patch_lang(fn)
            patched.update(need)
            return LaunchScope(scope)
        if not need <= patched:  # a helper seeing a module the launch did not patch
            nested.append(patch_lang(fn))
            patched.update(need)
        return None  # a helper's call ignores the scope

    interpreter._patch_lang = once


HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        _reimport_for_the_interpreter()
if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_lang_once_per_launch()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
