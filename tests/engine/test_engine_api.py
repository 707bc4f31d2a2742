"""`radixserve.Engine`, in this process, on a tiny random model: greedy text equals
transformers', and every way of asking (stream, async, batch, n, chat, structured output,
logprobs, abort) gives what /generate gives."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine, RequestError
from tests.executor.helpers import hf_greedy, make_hf_model, make_tokenizer, write_tiny_model

SEED = 11
OVERRIDES = {"max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("engine-api"), "llama", SEED, **OVERRIDES)


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return make_hf_model("llama", SEED, **OVERRIDES)


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with Engine(str(model_dir), device="cpu", max_total_tokens=8192, show_progress=False) as e:
        yield e


GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_generate_is_the_greedy_continuation(engine: Engine, hf: Any, tok: Any) -> None:
    out = engine.generate("the thin cat", GREEDY)
    assert isinstance(out, dict)
    want = hf_greedy(hf, tok.encode("the thin cat"), 12)
    assert out["output_ids"] == want
    assert out["text"] == tok.decode(want, skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(tok.encode("the thin cat"))
    assert meta["completion_tokens"] == 12 and meta["finish_reason"]["type"] == "length"
    by_ids = engine.generate(input_ids=tok.encode("the thin cat"), sampling_params=GREEDY)
    assert isinstance(by_ids, dict) and by_ids["output_ids"] == want


def test_a_batch_and_n_samples_answer_a_list(engine: Engine) -> None:
    batch = engine.generate(["one", "two", "three"], GREEDY)
    assert isinstance(batch, list) and [b["index"] for b in batch] == [0, 1, 2]
    alone = [engine.generate(p, GREEDY) for p in ("one", "two", "three")]
    assert [b["output_ids"] for b in batch] == [a["output_ids"] for a in alone]
    samples = engine.generate("one", {"max_new_tokens": 6, "n": 3, "seed": 4})
    assert isinstance(samples, list) and len(samples) == 3
    assert len({tuple(s["output_ids"]) for s in samples}) > 1  # seeds 4, 5, 6


def test_streaming_is_cumulative_and_ends_with_the_whole_result(engine: Engine) -> None:
    whole = engine.generate("the sea", GREEDY)
    chunks = list(engine.generate("the sea", GREEDY, stream=True))
    assert len(chunks) > 1
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_async_callers_interleave_and_agree_with_sync(engine: Engine) -> None:
    prompts = [f"prompt number {i}" for i in range(8)]

    async def main() -> list[Any]:
        return await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in prompts))

    results = asyncio.run(main())
    assert [r["output_ids"] for r in results] == [
        engine.generate(p, GREEDY)["output_ids"] for p in prompts
    ]

    async def streamed() -> list[Any]:
        it = await engine.async_generate("the sea", GREEDY, stream=True)
        return [c async for c in it]

    chunks = asyncio.run(streamed())
    assert chunks[-1]["output_ids"] == engine.generate("the sea", GREEDY)["output_ids"]


def test_chat_goes_through_the_template(engine: Engine, hf: Any, tok: Any) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    out = engine.chat(messages, GREEDY)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = hf_greedy(hf, tok.encode(text, add_special_tokens=False), 12)
    assert isinstance(out, dict) and out["output_ids"] == want


def test_structured_output_and_logprobs(engine: Engine, hf: Any, tok: Any) -> None:
    out = engine.generate("number:", {"regex": "[0-9]{3}", "temperature": 1.0, "seed": 3})
    assert isinstance(out, dict) and re.fullmatch("[0-9]{3}", out["text"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = engine.generate("json:", {"json_schema": schema, "max_new_tokens": 30})
    assert isinstance(out, dict) and isinstance(json.loads(out["text"])["ok"], bool)
    ids = tok.encode("the thin cat")
    scored = engine.generate(
        "the thin cat",
        {"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
        return_text_in_logprobs=True,
    )
    assert isinstance(scored, dict) and scored["output_ids"] == []
    entries = scored["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and entries[0][0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    torch.testing.assert_close(
        torch.tensor([e[0] for e in entries[1:]]), torch.tensor(want), atol=1e-4, rtol=0
    )
    assert entries[1][2] == tok.decode([ids[1]])


def test_abort_ends_a_request_in_flight(engine: Engine) -> None:
    chunks = engine.generate(
        "a long story",
        {"max_new_tokens": 3000, "ignore_eos": True},
        rid="to-abort",
        stream=True,
    )
    seen = []
    for c in chunks:
        seen.append(c)
        if len(seen) == 3:
            assert engine.abort("to-abort")
    assert seen[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert seen[-1]["meta_info"]["completion_tokens"] < 3000
    assert not engine.abort("to-abort")  # ended: no longer in flight


def test_bad_parameters_raise_value_error_naming_the_field(engine: Engine) -> None:
    with pytest.raises(RequestError, match=r"sampling_params\.temperature must be >= 0") as e:
        engine.generate("x", {"temperature": -1})
    assert isinstance(e.value, ValueError) and e.value.param == "sampling_params.temperature"
    with pytest.raises(ValueError, match="unknown field"):
        engine.generate("x", {"temprature": 1})
    with pytest.raises(ValueError, match="invalid regex"):
        engine.generate("x", {"regex": "[^\\s\\S]"})
    with pytest.raises(ValueError, match="context length"):
        engine.generate("x", {"max_new_tokens": 10_000})


def test_cache_flush_model_info_and_shutdown(model_dir: Path, engine: Engine) -> None:
    engine.generate("warm the cache with this prompt", GREEDY)
    assert engine.flush_cache()
    again = engine.generate("warm the cache with this prompt", GREEDY)
    assert isinstance(again, dict) and again["meta_info"]["cached_tokens"] == 0
    info = engine.get_model_info()
    assert info["context_length"] == 4096 and info["architecture"] == "LlamaForCausalLM"
    assert info["has_chat_template"] is True and info["model_path"] == str(model_dir)
    with pytest.raises(ValueError, match="--max-total-tokens"):
        Engine(str(model_dir), device="cpu", max_total_tokens="many")
    # Two engines in one process are supported: each has its own model, pool and thread.
    with Engine(str(model_dir), device="cpu", max_total_tokens=2048, show_progress=False) as other:
        mine, theirs = engine.generate("the sea", GREEDY), other.generate("the sea", GREEDY)
        assert isinstance(mine, dict) and isinstance(theirs, dict)
        assert theirs["output_ids"] == mine["output_ids"] and theirs["text"] == mine["text"]
        model = weakref.ref(other.pipeline.engine.runner.model)
    with pytest.raises(RuntimeError, match="shut down"):
        other.generate("x", GREEDY)
    # Shut down, it holds on to nothing: its model (and with it its GPU memory) is gone while
    # the program goes on, so that another engine can take the memory.
    assert model() is None
    other.shutdown()  # a second shutdown is harmless


def test_a_long_lived_engine_forgets_finished_requests(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detokenizer remembers finished rids for a while to drop late tokens quietly; the
    engine lets it forget them, so memory does not grow with every request ever served."""
    from radixserve.engine import pipeline
    from services.detokenizer import core

    monkeypatch.setattr(pipeline, "EXPIRE_EVERY_S", 0.0)
    monkeypatch.setattr(core, "FINISHED_MEMORY_S", 0.0)
    with Engine(str(model_dir), device="cpu", max_total_tokens=2048, show_progress=False) as e:
        e.generate(["one", "two", "three"], GREEDY)
        detok = e.pipeline.detok
        deadline = time.monotonic() + 30
        while detok.finished and time.monotonic() < deadline:  # the stepping loop clears it
            time.sleep(0.01)
        assert not detok.finished and not detok.states


def test_a_rid_can_be_used_again_once_its_request_ended(engine: Engine) -> None:
    first = engine.generate("the sea", GREEDY, rid="mine")
    again = engine.generate("the sea", GREEDY, rid="mine")
    assert isinstance(first, dict) and isinstance(again, dict)
    assert again["meta_info"]["id"] == "mine" and again["output_ids"] == first["output_ids"]


def test_a_tensor_parallel_engine_answers_what_one_rank_answers(
    model_dir: Path, engine: Engine
) -> None:
    """tp_size=2 on the CPU: this process is rank 0, the other rank a process of its own
    (gloo); both stop with the engine."""
    with Engine(
        str(model_dir), device="cpu", max_total_tokens=4096, tp_size=2, show_progress=False
    ) as split:
        (rank1,) = split.group.children
        for text in ("the thin cat", "a b c"):
            mine, theirs = engine.generate(text, GREEDY), split.generate(text, GREEDY)
            assert isinstance(mine, dict) and isinstance(theirs, dict)
            assert theirs["output_ids"] == mine["output_ids"]
    assert rank1.returncode == 0  # it left its loop on the engine's stop


def test_encode_embeds_as_transformers_pools(
    model_dir: Path, hf: Any, tok: Any, engine: Engine
) -> None:
    with pytest.raises(RequestError, match="is_embedding=True"):
        engine.encode("a generation engine embeds nothing")
    flags: dict[str, Any] = {"device": "cpu", "max_total_tokens": 2048, "show_progress": False}
    with Engine(str(model_dir), is_embedding=True, embedding_pooling="last", **flags) as e:
        assert e.get_model_info()["is_generation"] is False
        texts = ["the thin cat", "a sea of words"]
        many = e.encode(texts)
        one = e.encode(texts[0])
        assert isinstance(many, list) and len(many) == 2 and isinstance(one, dict)
        # the same vector alone (its prompt now mostly from the prefix cache) as in a batch
        assert torch.allclose(
            torch.tensor(one["embedding"]), torch.tensor(many[0]["embedding"]), atol=1e-6
        )
        for text, got in zip(texts, many, strict=True):
            ids = tok(text)["input_ids"]
            assert got["meta_info"]["prompt_tokens"] == len(ids)
            with torch.no_grad():
                h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
            want = torch.nn.functional.normalize(h, dim=0)
            assert torch.allclose(torch.tensor(got["embedding"]), want, atol=1e-5)
        with pytest.raises(RequestError, match="serves embeddings"):
            e.generate("x", GREEDY)
