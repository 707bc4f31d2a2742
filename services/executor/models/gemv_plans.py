"""The launch configurations choose_gemv chose, kept between starts.

Timing every launch candidate of every projection shape takes 6-12 s of a start whose Triton
cache is full and 15-40 s of one whose cache is empty (each candidate compiles first). What
it chooses depends only on the GPU, the projection's shape and format, the activations'
dtype and the code of the kernels and their candidates, so the choices are saved under
$RADIXSERVE_CACHE_DIR/gemv (else $XDG_CACHE_HOME/radixserve/gemv, ~/.cache by default), one
JSON file per GPU and code version, and a later start with the same key reads them instead of
timing; only the kernels it chose then compile. Every candidate computes the same product, so
a saved choice can only be slower than a fresh one, never wrong: deleting the directory (or a
file) times again. Without a writable directory every start times, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from shared.caches import cache_home, locked

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
# The code a choice depends on: the kernels, the candidates and how each format launches them.
CODE = ("kernels", "services/executor/models/linear.py", "services/executor/quant")


def cache_dir() -> Path:
    """$RADIXSERVE_CACHE_DIR/gemv, else $XDG_CACHE_HOME (~/.cache)/radixserve/gemv."""
    return cache_home() / "gemv"


def code_digest() -> str:
    """A digest of every .py file under CODE (relative to the repository), names and bytes:
    a change to a kernel or a candidate list starts a new file."""
    h = hashlib.sha256()
    files: list[Path] = []
    for p in CODE:
        path = ROOT / p
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    for f in files:
        h.update(f"{f.relative_to(ROOT)}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def file_name(gpu: str, capability: tuple[int, int]) -> str:
    """The GPU, the libraries that compile and time the kernels, whether launches are
    dependent (RADIXSERVE_PDL), and the code: one file for each combination."""
    parts = [gpu, f"sm{capability[0]}{capability[1]}", f"pdl={os.environ.get('RADIXSERVE_PDL')}"]
    parts += [f"{lib}={metadata.version(lib)}" for lib in ("torch", "triton")]
    parts.append(code_digest())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24] + ".json"


class PlanStore:
    """The saved choices of one GPU and code version: shape labels -> (plan, microseconds
    saved), read when made and written back with what this start timed (`save`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.plans: dict[str, tuple[dict[int, Any], float]] = self._read()
        self.new: dict[str, tuple[dict[int, Any], float]] = {}

    @classmethod
    def for_device(cls, device: Any) -> PlanStore | None:
        """The store of CUDA device `device`; None where no file can be named for it."""
        import torch

        try:
            name = file_name(
                torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
            )
        except (OSError, RuntimeError, metadata.PackageNotFoundError) as e:
            log.warning("gemv choices not kept between starts: %s", e)
            return None
        return cls(cache_dir() / name)

    def get(self, label: str) -> tuple[dict[int, Any], float] | None:
        return self.plans.get(label)

    def put(self, label: str, plan: dict[int, Any], saved_us: float) -> None:
        self.plans[label] = self.new[label] = (dict(plan), saved_us)

    def save(self) -> None:
        """Merge this start's choices into the file (others may have added theirs since it
        was read), whole or not at all; a cache that cannot be written is only logged."""
        if not self.new:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with locked(self.path.with_suffix(".lock")):
                merged = {**self._read(), **self.new}
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.path.parent)
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump({label: self._encode(*v) for label, v in merged.items()}, f)
                    os.replace(tmp, self.path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
        except OSError as e:
            log.warning("gemv choices not saved to %s: %s", self.path, e)
            return
        self.new = {}
        log.info("gemv choices saved to %s: later starts on this GPU read them", self.path)

    def _read(self) -> dict[str, tuple[dict[int, Any], float]]:
        try:
            raw = json.loads(self.path.read_text())
            return {label: self._decode(v) for label, v in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning("gemv choices in %s do not read (%r): timing again", self.path, e)
            return {}

    @staticmethod
    def _encode(plan: dict[int, Any], saved_us: float) -> dict[str, Any]:
        return {"rows": {str(m): asdict(cfg) for m, cfg in plan.items()}, "saved_us": saved_us}

    @staticmethod
    def _decode(v: dict[str, Any]) -> tuple[dict[int, Any], float]:
        # here, not at the top: models/linear.py imports this module
        from services.executor.models.linear import GemvConfig

        plan = {int(m): GemvConfig(**cfg) for m, cfg in v["rows"].items()}
        return plan, float(v["saved_us"])
