"""Where radixserve keeps what one start saves for the next (the tokenizers of
shared/tokenizer_cache.py, the executor's gemv choices of services/executor/models/
gemv_plans.py), and the file lock processes that fill it at the same time share."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

CACHE_ENV = "RADIXSERVE_CACHE_DIR"


def cache_home() -> Path:
    """$RADIXSERVE_CACHE_DIR, else $XDG_CACHE_HOME (~/.cache)/radixserve."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "radixserve")
    return Path(base)


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """An exclusive flock on lock_path for the block; without one (a filesystem that refuses
    locks), the block runs unlocked: at worst two processes both do its work."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
