"""Compile the Triton kernels a list of launches needs side by side, in threads, before they
are timed or captured one after another.

A first launch of a kernel specialisation compiles it: Triton's front end (Python), MLIR and
LLVM passes and ptxas, most of which runs outside the GIL. The start-up timing of the
projections' launch candidates (`choose_gemv`) compiles each one as it first times it, in
sequence: 97 s of a 117 s first start for a tiny int4 model on an H200, where Triton's cache
(a second start) took it to 6 s. Calling each launch once in a pool of threads first fills
Triton's in-memory kernel cache with every specialisation, so the timing that follows
compiles nothing. Many launches share a specialisation (projections of different shapes, one
kernel), so a thread that reaches one another thread is compiling skips its launch (Triton's
`jit_cache_hook`) rather than compiling it a second time beside the first. Triton's own
`AsyncCompileMode` compiles in an executor too, but a launch under it still waits for its own
compile; each call here runs in its own thread instead, so the launchers need no
compile-only path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from triton import knobs

log = logging.getLogger(__name__)

MAX_THREADS = 16  # past this the front end's share, which holds the GIL, sets the pace


def compile_threads() -> int:
    """The threads this process may use: the CPUs it may run on, at most MAX_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


def compile_ahead(
    calls: Sequence[Callable[[], object]], device: torch.device, threads: int | None = None
) -> int:
    """Run each call once, in a pool of `threads` threads (compile_threads() by default), each
    on `device` and in inference mode as the caller is; wait for the device. A call that
    raises is left to its caller's own first launch to report (a launch configuration this
    GPU cannot run, say). Returns the number of calls that raised."""
    if not calls:
        return 0
    threads = min(len(calls), threads or compile_threads())
    ours = threading.local()
    claimed: set[tuple[int, object]] = set()
    lock = threading.Lock()
    earlier = knobs.runtime.jit_cache_hook

    def claim(*, key: object, fn: Any, **rest: Any) -> bool | None:
        """Triton asks before compiling a specialisation it has not cached. Many calls
        compile the same one (shapes differ, the kernel does not): the first of our threads
        to ask compiles it; the others skip their launch (True) instead of compiling it
        again side by side. Other threads' launches go on as usual."""
        if earlier is not None and earlier(key=key, fn=fn, **rest):
            return True
        if not getattr(ours, "active", False):
            return None
        with lock:
            if (id(fn.jit_function), key) in claimed:
                return True
            claimed.add((id(fn.jit_function), key))
        return None

    def one(call: Callable[[], object]) -> bool:
        # Each thread starts on CUDA's device 0 and outside inference mode: both are per
        # thread, and a launch on the wrong device would compile and run for that one.
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ours.active = True
        try:
            with torch.inference_mode():
                call()
        except Exception as e:
            log.debug("compile ahead: a call raised %s", e)
            return False
        return True

    start = time.monotonic()
    knobs.runtime.jit_cache_hook = claim
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
            failed = sum(not ok for ok in pool.map(one, calls))
    finally:
        knobs.runtime.jit_cache_hook = earlier
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info(
        "%d launches compiled in %.1fs on %d threads", len(calls), time.monotonic() - start, threads
    )
    return failed
