"""Ending a process that stopped cleanly without the interpreter's teardown.

`radixserve serve` and the services it forks freeze their heap once started (gc.freeze: the
collector then never walks the libraries and the model's tables again). Any of them that
imported triton (serve for a GGUF model's check; every service forked from the zygote) then
prints a page of nanobind "leaked" warnings at teardown: triton's bindings are never freed
from a frozen heap. Teardown has nothing else left to do for them once they have stopped
cleanly, so they end here: the exit handlers run (logging's flush among them), the standard
streams are flushed, and the process exits without freeing what the kernel frees anyway. A
failure still goes through the normal exit, traceback and all.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int = 0) -> NoReturn:
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
