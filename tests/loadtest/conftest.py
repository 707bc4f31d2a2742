"""A small real tokenizer (byte-level BPE trained on the benchmark's own text) and fixtures."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loadtest.textgen import TextSource, paragraph
from tests.loadtest.fake_server import FakeServer, Script


@pytest.fixture(scope="session")
def bpe() -> Tokenizer:
    """Byte-level BPE with 400 ids: common words are one token, rarer ones split, as in a real
    model's vocabulary (so cut points and re-tokenization drift are real)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    rng = random.Random(0)
    tok.train_from_iterator((paragraph(rng, 20) for _ in range(100)), trainer)
    return tok


@pytest.fixture(scope="session")
def bpe_path(bpe: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    bpe.save(str(path))
    return path


@pytest.fixture
def source(bpe: Tokenizer) -> TextSource:
    return TextSource(bpe, seed=7)


@pytest.fixture
async def start_fake() -> AsyncIterator[Callable[[Script], Awaitable[FakeServer]]]:
    """Start FakeServers with a script; all are stopped after the test."""
    started: list[FakeServer] = []

    async def start(script: Script) -> FakeServer:
        server = FakeServer(script)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()
