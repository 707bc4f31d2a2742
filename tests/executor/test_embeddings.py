"""Embeddings (--is-embedding): pooled vectors equal transformers' hidden states pooled the
same way, with chunked prefill, the prefix cache and the overlapped schedule; generation and
embedding requests are refused by the wrong kind of executor; pooling read from the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoModel

from services.executor.engine.loop import Engine
from services.executor.errors import UnsupportedModelError
from services.executor.sampling.pooling import model_pooling
from shared.messages.detok import RequestFailed, TokenDelta
from tests.executor.helpers import write_tiny_model
from tests.executor.test_engine import make_engine, make_request, prompts

SEED = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("embed"), "llama", SEED)


def hf_embedding(model_dir: Path, ids: list[int], pooling: str) -> np.ndarray:
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    v = h[-1] if pooling == "last" else h.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=0).numpy()


def embed_all(engine: Engine, reqs: list[list[int]]) -> dict[str, np.ndarray]:
    for i, ids in enumerate(reqs):
        engine.submit(msgspec.structs.replace(make_request(f"e{i}", ids, 0), embed=True))
    got: dict[str, np.ndarray] = {}
    while engine.has_work():
        for _, msg in engine.step().outputs:
            assert not isinstance(msg, RequestFailed), msg
            for d in getattr(msg, "deltas", []):
                assert isinstance(d, TokenDelta) and not d.token_ids  # nothing generated
                if d.finish is not None:
                    assert d.embedding is not None
                    got[d.rid] = np.frombuffer(d.embedding, dtype="<f4")
    return got


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("overlap", [False, True])
def test_pooled_vectors_match_transformers(model_dir: Path, pooling: str, overlap: bool) -> None:
    # Prompts in several chunks (max_prefill_tokens 8), two sharing a 20-token prefix so the
    # second finds it cached (mean pooling must compute it again: every token is pooled).
    shared = prompts(8, seed=3)[7][:20]
    reqs = [*prompts(6, seed=1), [*shared, 5, 6, 7], [*shared, 9, 10]]
    engine = make_engine(
        model_dir,
        overlap=overlap,
        is_embedding=True,
        embedding_pooling=pooling,
        max_prefill_tokens=8,
    )
    got = embed_all(engine, reqs[:-1])
    got |= {"e7": embed_all(engine, [reqs[-1]])["e0"]}  # after e6's prompt went to the cache
    assert len(got) == len(reqs)
    for i, ids in enumerate(reqs):
        want = hf_embedding(model_dir, ids, pooling)
        np.testing.assert_allclose(got[f"e{i}"], want, atol=2e-5, rtol=1e-4)
        assert abs(np.linalg.norm(got[f"e{i}"]) - 1) < 1e-5
    engine.policy.check_integrity()  # no slot leaked


def test_the_wrong_kind_of_request_is_refused(model_dir: Path) -> None:
    embedder = make_engine(model_dir, is_embedding=True)
    generator = make_engine(model_dir)
    for engine, req, want in (
        (embedder, make_request("g", [1, 2, 3], 4), "serves embeddings"),
        (generator, msgspec.structs.replace(make_request("e", [1, 2], 0), embed=True), "text"),
    ):
        engine.submit(req)
        failures = [m for _, m in engine.step().outputs if isinstance(m, RequestFailed)]
        assert len(failures) == 1 and failures[0].error.status == 400
        assert want in failures[0].error.message
        assert not engine.has_work()


def test_pooling_comes_from_the_sentence_transformers_config(tmp_path: Path) -> None:
    assert model_pooling(str(tmp_path)) == "last"  # a decoder that declares none
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [{"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    config = tmp_path / "1_Pooling" / "config.json"
    for modes, want in (
        ({"pooling_mode_mean_tokens": True}, "mean"),
        ({"pooling_mode_lasttoken": True}, "last"),
    ):
        config.write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
        assert model_pooling(str(tmp_path)) == want
        assert model_pooling(str(tmp_path), "mean") == "mean"  # the flag wins
    config.write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(UnsupportedModelError, match="cls_token"):
        model_pooling(str(tmp_path))


def test_matryoshka_dimensions_shorten_and_renormalise(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "llama", SEED)
    config = json.loads((path / "config.json").read_text())
    plain = make_engine(path, is_embedding=True)
    plain.submit(msgspec.structs.replace(make_request("d", [1, 2, 3], 0), embed=True, dimensions=8))
    failures = [m for _, m in plain.step().outputs if isinstance(m, RequestFailed)]
    assert failures and "not supported by this model" in failures[0].error.message
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16]}))
    engine = make_engine(path, is_embedding=True, embedding_pooling="mean")
    ids = prompts(4, seed=2)[3]
    engine.submit(msgspec.structs.replace(make_request("d", ids, 0), embed=True, dimensions=8))
    engine.submit(msgspec.structs.replace(make_request("x", ids, 0), embed=True, dimensions=9))
    got: dict[str, Any] = {}
    while engine.has_work():
        for _, msg in engine.step().outputs:
            if isinstance(msg, RequestFailed):
                got[msg.rid] = msg.error.message
            for d in getattr(msg, "deltas", []):
                if d.embedding is not None:
                    got[d.rid] = np.frombuffer(d.embedding, dtype="<f4")
    assert "one of [8, 16]" in got["x"]
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        mean = hf(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
    want = torch.nn.functional.normalize(mean[:8], dim=0).numpy()
    np.testing.assert_allclose(got["d"], want, atol=2e-5, rtol=1e-4)
