"""Embeddings through every service (`radixserve serve --is-embedding`): the `openai`
client's embeddings.create (base64, as it asks by default, and float), SMG's gRPC Embed, the
same vectors as transformers' hidden states pooled the same way, and the 400s that keep the
generation and embedding endpoints apart."""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest
import requests
import torch
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from transformers import AutoModel

from tests.e2e.stack import Stack, start_stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def embed_stack(
    redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack = start_stack(
        [
            *("--model", str(tiny_model_dir), "--max-total-tokens", "4096", "--is-embedding"),
            *("--embedding-pooling", "mean", "--max-prefill-tokens", "16", "--check-integrity"),
        ],
        tmp_path_factory.mktemp("logs") / "embed-stack.log",
        redis_url.rsplit("/", 1)[0] + "/5",
        grpc=True,
    )
    yield stack
    assert stack.stop() == 0, stack.log_tail()


@functools.cache
def hf_model(model_dir: Path) -> Any:
    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_mean(model_dir: Path, ids: list[int]) -> np.ndarray:
    hf = hf_model(model_dir)
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
    return torch.nn.functional.normalize(h, dim=0).numpy()


def test_openai_client_embeddings_match_transformers(
    embed_stack: Stack, tiny_model_dir: Path, tiny_tokenizer: Any
) -> None:
    client = openai.OpenAI(base_url=f"{embed_stack.base_url}/v1", api_key="x", max_retries=0)
    texts = ["the thin cat sat on the mat", "a much longer sentence, " * 5 + "to split"]
    ids = [[3, 14, 15, 92, 65, 35]]
    prompts = [tiny_tokenizer(t)["input_ids"] for t in texts]
    # The client asks for base64 unless told otherwise and decodes it to floats itself; told
    # "base64", it hands the text over as it came.
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        r = client.embeddings.create(
            model=tiny_model_dir.name,
            input=texts,
            encoding_format=fmt,
        )
        assert [d.index for d in r.data] == [0, 1]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, prompts))
        for d, p in zip(r.data, prompts, strict=True):
            raw: Any = d.embedding
            got = np.frombuffer(base64.b64decode(raw), "<f4") if fmt == "base64" else raw
            np.testing.assert_allclose(got, hf_mean(tiny_model_dir, p), atol=1e-4)
    r = client.embeddings.create(model=tiny_model_dir.name, input=ids)
    got = np.asarray(r.data[0].embedding, dtype=np.float32)
    np.testing.assert_allclose(got, hf_mean(tiny_model_dir, ids[0]), atol=1e-4)


def test_smg_grpc_embed(embed_stack: Stack, tiny_model_dir: Path) -> None:
    assert embed_stack.grpc_target is not None
    ids = [5, 6, 7, 8, 9]
    with grpc.insecure_channel(embed_stack.grpc_target) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        r = stub.Embed(sgl.EmbedRequest(tokenized=sgl.TokenizedInput(input_ids=ids)))
        assert r.prompt_tokens == len(ids) and r.embedding_dim == len(r.embedding)
        want = hf_mean(tiny_model_dir, ids)
        np.testing.assert_allclose(np.asarray(r.embedding, dtype=np.float32), want, atol=1e-4)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(sgl.GenerateRequest(tokenized=sgl.TokenizedInput(input_ids=ids))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_requests_and_the_other_endpoints_are_400s(
    embed_stack: Stack, tiny_stack: Stack
) -> None:
    url = embed_stack.base_url
    bad: list[tuple[Any, str]] = [
        ({"input": []}, "input"),
        ({"input": [[1, 2], 7]}, "input[1]"),
        ({"input": "x", "dimensions": 8}, "dimensions"),  # the tiny model declares no Matryoshka
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "pooling": "cls"}, "pooling"),
        ({"input": ["ok", "x" * 5000]}, "input"),  # past the 4,096-token context
    ]
    for body, param in bad:
        r = requests.post(f"{url}/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = requests.post(f"{url}/v1/embeddings", json={"input": "x", "model": "other"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    generation: list[tuple[str, Any]] = [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/generate", {"text": "x"}),
        ("/v1/responses", {"input": "x"}),
    ]
    for path, gen_body in generation:
        r = requests.post(f"{url}{path}", json=gen_body, timeout=30)
        assert r.status_code == 400 and "/v1/embeddings" in r.text, r.text
    # and a generation server refuses embeddings
    r = requests.post(f"{tiny_stack.base_url}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 400 and "--is-embedding" in r.text, r.text
    # nothing above leaked a request: every reply queue was let go
    metrics = requests.get(f"{url}/metrics", timeout=30).text
    inflight = [line for line in metrics.splitlines() if line.startswith("radixserve:inflight")]
    assert inflight and all(line.endswith(" 0.0") for line in inflight), inflight


def test_health_probe_and_model_info_in_embedding_mode(embed_stack: Stack) -> None:
    r = requests.get(f"{embed_stack.base_url}/health_generate", timeout=60)
    assert r.status_code == 200, r.text  # the probe is an embedding, which this server serves
    info = requests.get(f"{embed_stack.base_url}/get_model_info", timeout=30).json()
    assert info["is_generation"] is False
