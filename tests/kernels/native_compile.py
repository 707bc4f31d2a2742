"""Compile every Triton kernel of kernels/ for a Hopper GPU (sm_90) on a machine without one.

CI has no GPU, so the kernel tests run in Triton's CPU interpreter, which never runs the
compiler: a kernel the compiler rejects (an if/else giving one name two shapes, say) passes CI
and fails only on the GPU. This harness puts a fake sm_90 driver in Triton's place and makes
every launch compile without launching (Triton's warmup), then calls each launcher of kernels/
with small CPU tensors (tests/kernels/native_compile_cases.py): every variant a case reaches is
compiled down to a cubin by the wheel's own ptxas, as the GPU would compile it.

    python -m tests.kernels.native_compile                  # every case, then the coverage check
    python -m tests.kernels.native_compile rmsnorm mla_prep/bf16-interleave   # groups or cases
    python -m tests.kernels.native_compile --list
    python -m tests.kernels.native_compile --jobs 8          # worker processes (default 4 at most)

Run it without TRITON_INTERPRET (the interpreter decides at @triton.jit time). Exit status 1
if a case fails or, when every case ran, if a `*_kernel` of kernels/ was launched by none of
them (a new kernel needs a case).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import pkgutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction, KernelInterface

import kernels
import kernels._checks
import kernels.fp8_gemv_packed
import kernels.fp8_widen
import kernels.pdl
import kernels.w4a16_mma

TARGET = GPUTarget("cuda", 90, 32)
# An H100's shared memory per block (opt-in maximum): a launch asking more fails on the GPU
# when the cubin is loaded, which a compile-only run never does, so it is checked here.
MAX_SHARED_BYTES = 232448


@dataclass(frozen=True)
class Case:
    """One launcher call; `name` is "group/variant", the group usually the kernel's file."""

    name: str
    run: Callable[[], object]
    pdl: bool = True  # launch with PDL (what a Hopper GPU runs), or without

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0]


@dataclass(frozen=True)
class Result:
    case: Case
    seconds: float
    kernels: tuple[str, ...]  # the kernels launched (qualified names), in order
    error: str | None


class _Sm90Driver(DriverBase):
    """Just enough of a driver for Triton to compile for TARGET; nothing is ever launched."""

    def __init__(self) -> None:
        pass

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self) -> Any:
        return torch.cuda

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("compile-only driver: nothing runs")


_launched: list[str] = []  # every kernel launched (compiled, or failing to) since install()
_pdl_on = True
_installed = False


def install() -> None:
    """Put the fake sm_90 driver in place and make launches compile only. Raises if that
    cannot be done (the interpreter is on, or this Triton has no NVIDIA backend)."""
    global _installed
    if _installed:
        return
    if kernels._checks.interpreting():
        raise RuntimeError(
            "native_compile: unset TRITON_INTERPRET (the interpreter never compiles)"
        )
    from triton.backends import backends

    if "nvidia" not in backends:
        raise RuntimeError(f"native_compile: this Triton has no NVIDIA backend ({list(backends)})")
    driver.set_active(_Sm90Driver())
    if driver.active.get_current_target() != TARGET:
        raise RuntimeError("native_compile: Triton did not take the fake sm_90 driver")
    # Every variant compiled here, never read from a cache of an earlier run.
    knobs.compilation.always_compile = True
    original_run = JITFunction.run

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        _launched.append(f"{self.fn.__module__}.{self.fn.__qualname__}")
        kernel = original_run(self, *args, grid=grid, warmup=True, **kw)
        if kernel is not None and kernel.metadata.shared > MAX_SHARED_BYTES:
            raise OutOfResources(kernel.metadata.shared, MAX_SHARED_BYTES, "shared memory")
        return kernel

    JITFunction.run = compile_only
    # The launchers take CPU tensors only in the interpreter, and launch with PDL only on a
    # device that has it: both as on a Hopper GPU here.
    kernels._checks.interpreting = lambda: True
    # ... while the inline PTX of kernels/fp8_widen.py, kernels/fp8_gemv_packed.py and
    # kernels/w4a16_mma.py, refused by the interpreter, compiles here.
    kernels.fp8_widen.interpreting = lambda: False
    kernels.fp8_gemv_packed.interpreting = lambda: False
    kernels.w4a16_mma.interpreting = lambda: False
    kernels.pdl.pdl_enabled = lambda device: _pdl_on
    _installed = True


def run_case(case: Case) -> Result:
    """Compile what `case` launches (install() first); a failure is returned, not raised."""
    global _pdl_on
    _pdl_on = case.pdl
    start, first = time.perf_counter(), len(_launched)
    error = None
    try:
        case.run()
    except (triton.CompilationError, OutOfResources) as e:  # the compiler's own message
        error = f"{type(e).__name__}: {e}"
    except Exception:
        error = traceback.format_exc()
    return Result(case, time.perf_counter() - start, tuple(_launched[first:]), error)


def kernel_names() -> set[str]:
    """The qualified names of the `*_kernel` Triton functions that kernels/ defines (JIT or,
    under TRITON_INTERPRET, interpreted: the names are the same)."""
    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        for value in vars(module).values():
            fn = value
            while isinstance(fn, KernelInterface):  # an autotuner wraps the JIT function
                fn = fn.fn
            if (
                fn is not value
                and fn.__module__ == module.__name__
                and fn.__name__.endswith("_kernel")
            ):
                names.add(f"{module.__name__}.{fn.__qualname__}")
    return names


def select(cases: Sequence[Case], names: Sequence[str]) -> list[Case]:
    """The cases named, each name a case's or a group's; ValueError for one that is neither."""
    if not names:
        return list(cases)
    unknown = [n for n in names if not any(n in (c.name, c.group) for c in cases)]
    if unknown:
        raise ValueError(f"no case or group named {', '.join(unknown)} (see --list)")
    return [c for c in cases if c.name in names or c.group in names]


def report(result: Result) -> str:
    status = "ok  " if result.error is None else "FAIL"
    pdl = "" if result.case.pdl else ", no PDL"
    launched = ", ".join(dict.fromkeys(k.rsplit(".", 1)[1] for k in result.kernels))
    line = f"{status} {result.seconds:6.2f}s  {result.case.name} ({launched or 'nothing'}{pdl})"
    if result.error is not None:
        line += "\n" + "\n".join("      " + s for s in result.error.rstrip().splitlines())
    return line


def _run_named(name: str) -> Result:
    """A pool worker's task (the worker ran install())."""
    from tests.kernels.native_compile_cases import CASES

    return run_case(next(c for c in CASES if c.name == name))


def run_all(cases: Sequence[Case], jobs: int) -> Iterator[Result]:
    """Each case's result, in order; with jobs > 1, compiled by that many worker processes
    (the compiler is mostly single-threaded). Spawned, not forked: each worker imports and
    installs afresh, with no threads or state of this process carried over."""
    if jobs <= 1:
        yield from map(run_case, cases)
        return
    with multiprocessing.get_context("spawn").Pool(jobs, initializer=install) as pool:
        yield from pool.imap(_run_named, [c.name for c in cases])


def main(argv: Sequence[str] | None = None) -> int:
    from tests.kernels.native_compile_cases import CASES

    parser = argparse.ArgumentParser(prog="python -m tests.kernels.native_compile")
    parser.add_argument("names", nargs="*", help="cases or groups (default: all, and coverage)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--jobs", type=int, help="worker processes (default: 1 with names)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(c.name for c in CASES))
        return 0
    try:
        cases = select(CASES, args.names)
    except ValueError as e:
        parser.error(str(e))
    jobs = args.jobs or (1 if args.names else min(4, len(os.sched_getaffinity(0))))
    install()
    start = time.perf_counter()
    launched: set[str] = set()
    failed = 0
    for result in run_all(cases, jobs):
        launched.update(result.kernels)
        failed += result.error is not None
        print(report(result), flush=True)
    missing = sorted(kernel_names() - launched) if not args.names else []
    for name in missing:
        print(f"FAIL  no case compiles {name}: add one to tests/kernels/native_compile_cases.py")
    seconds = time.perf_counter() - start
    print(f"{len(cases) - failed} of {len(cases)} cases compiled for sm_90 in {seconds:.1f}s")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    # Through the module's import name, so the cases share this module's state (Case, the
    # launched-kernel record) rather than a second copy of it run as __main__.
    from tests.kernels.native_compile import main as _main

    sys.exit(_main())
