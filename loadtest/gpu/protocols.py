"""gRPC against HTTP through the whole stack on the GPU: `radixserve serve` with Llama-3.1-8B
shapes (dummy weights) and --grpc-port, then `radixserve-loadtest protocols` against it."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path
from typing import Any

from loadtest import protocols
from loadtest.gpu.models import llama8b_dir
from loadtest.gpu.sections import _serve
from tests.conftest import free_port


def protocols_section(out_dir: str) -> dict[str, Any]:
    model = llama8b_dir(Path(tempfile.mkdtemp()), "words")
    port, grpc_port = free_port(), free_port()
    log = Path(out_dir) / "protocols_serve.log"
    proc = _serve(model, log, port, "--grpc-port", str(grpc_port))
    try:
        record = protocols.main(
            [
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--grpc-target",
                f"127.0.0.1:{grpc_port}",
                "--tokenizer",
                str(model),
                "--rounds",
                "2",
                "--out",
                str(Path(out_dir) / "protocols.json"),
            ]
        )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return {"summary": record["summary"], "runs": record["runs"]}
