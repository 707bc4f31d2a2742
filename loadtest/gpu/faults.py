"""The `faults` section: `radixserve-loadtest faults` on the GPU, every service killed mid-load.

`radixserve serve` runs Llama-3.1-8B's shapes with dummy weights on the GPU (CUDA graphs, the
start-up timing of every projection: what a restarted executor goes through), and each
scenario of loadtest/faults.py breaks it once under a steady load: each service SIGKILLed (the
executor with a second one beside it on the same GPU), Redis stopped and started again, and
the hostile inputs. Each row counts the requests answered, answered after a Retry-After,
failed fast and hung, and the seconds from the fault to the first success of a request sent
after it. The KV pool is fixed (--max-total-tokens), so that two executors share one GPU.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from loadtest.faults import SCENARIOS, Settings, run_all, table
from loadtest.gpu.models import llama8b_dir


def gpu_faults_section(log_dir: str) -> dict[str, Any]:
    # "bytes": a tokenizer that spells any text, so the hostile inputs reach the grammar
    # compiler and the sampler as they would with a real model's vocabulary
    model = llama8b_dir(Path(tempfile.mkdtemp()), tokenizer="bytes")
    settings = Settings(
        interval=0.1, hang_s=120.0, before_ok=20, after_ok=50, recover_timeout=240.0,
        redis_down_s=5.0, max_tokens=16,
    )  # fmt: skip
    serve_args = ["--model", str(model), "--load-format", "dummy", "--max-total-tokens", "65536"]
    rows = run_all(list(SCENARIOS), settings, serve_args, Path(log_dir) / "faults")
    print(table(rows), flush=True)
    return {
        "rows": rows,
        "hung": sum(r["hung"] for r in rows),
        "errors": [r for r in rows if "error" in r],
    }
