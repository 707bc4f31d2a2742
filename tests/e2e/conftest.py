"""A session-wide stack serving a tiny random model, through every service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import free_port_block
from tests.e2e.stack import Stack, start_stack
from tests.executor.helpers import make_hf_model, make_tokenizer, write_tiny_model

TINY_SEED = 11
TINY_OVERRIDES = {"max_position_embeddings": 4096}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("e2e"), "llama", TINY_SEED, **TINY_OVERRIDES)


@pytest.fixture(scope="session")
def tiny_hf() -> torch.nn.Module:
    return make_hf_model("llama", TINY_SEED, **TINY_OVERRIDES)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_stack(
    redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack_redis = redis_url.rsplit("/", 1)[0] + "/1"
    stack = start_stack(
        [
            "--model",
            str(tiny_model_dir),
            "--max-total-tokens",
            "8192",
            "--check-integrity",
            "--detokenizer-partitions",
            "2",
            "--metrics-port",
            str(free_port_block()),
        ],
        tmp_path_factory.mktemp("logs") / "tiny-stack.log",
        stack_redis,
        grpc=True,
    )
    yield stack
    code = stack.stop()
    assert code == 0, f"serve exited with {code} on Ctrl-C\n{stack.log_tail()}"
    assert "Traceback" not in stack.log_path.read_text(errors="replace"), stack.log_tail(200)
