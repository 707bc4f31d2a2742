"""`radixserve serve` parses its flags and checks the model before it starts anything, and
does so without torch, transformers or xgrammar (about 3 s of CPU at every start); the
executor's flags, defined apart from the executor for this, still name its real choices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.executor.builder import KV_CACHE_DTYPES
from services.executor.flags import KV_CACHE_DTYPE_NAMES
from tests.executor.helpers import write_tiny_model

HEAVY = ("torch", "transformers", "xgrammar")


def test_serve_parses_and_checks_a_model_without_heavy_imports(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path, "llama", 3)
    code = (
        "import sys\n"
        "import radixserve.launcher as launcher\n"
        f"a = launcher.parse_args(['--model', {str(model)!r}, '--kv-cache-dtype', 'fp8_e5m2'])\n"
        "print(launcher.check_model(a))\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [model.name, "[]"]


def test_the_kv_cache_flag_names_every_pool_dtype() -> None:
    assert list(KV_CACHE_DTYPE_NAMES) == list(KV_CACHE_DTYPES)
