"""What load_model says about checkpoints it can't use, and the other layouts it accepts."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.executor.errors import ModelLoadError, UnsupportedModelError
from services.executor.weights import load_model

from .helpers import BatchDriver, make_hf_model, write_tiny_model
from .test_models import PROMPTS


def _last_logits(path: Path) -> torch.Tensor:
    model, config = load_model(path, "cpu", torch.float32)
    driver = BatchDriver(model, config)
    return driver.extend([driver.new_request()], [PROMPTS[0]])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", tie_word_embeddings=False)


def _copy_config_only(src: Path, dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as err:
        load_model(tmp_path)
    assert "LlamaForCausalLM" in str(err.value) and "Qwen3ForCausalLM" in str(err.value)


def test_unsupported_gguf_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        load_model(path)


def test_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"nowhere"):
        load_model(tmp_path / "nowhere")


def test_directory_without_weights_is_named(tmp_path: Path, tiny_dir: Path) -> None:
    empty = _copy_config_only(tiny_dir, tmp_path / "no-weights")
    with pytest.raises(ModelLoadError, match=f"no weights .* in {re.escape(str(empty))}"):
        load_model(empty)
    # ...but a dummy load only needs the config.
    model, _ = load_model(empty, load_format="dummy")
    assert model.lm_head.weight.shape == (264, 64)


def test_directory_without_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path))):
        load_model(tmp_path)


def test_corrupt_safetensors_is_named(tmp_path: Path, tiny_dir: Path) -> None:
    broken = _copy_config_only(tiny_dir, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(broken)


def test_corrupt_gguf_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 40)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf"):
        load_model(path)


def test_missing_and_unexpected_weights_are_named(tmp_path: Path, tiny_dir: Path) -> None:
    weights = load_file(tiny_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(128)
    bad = _copy_config_only(tiny_dir, tmp_path / "bad")
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ModelLoadError) as err:
        load_model(bad)
    message = str(err.value)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected: model.layers.0.mlp.gate_proj.bias" in message


def test_mis_shaped_weight_is_named(tmp_path: Path, tiny_dir: Path) -> None:
    weights = load_file(tiny_dir / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(63)
    bad = _copy_config_only(tiny_dir, tmp_path / "bad")
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.norm.weight has shape \(63,\)"):
        load_model(bad)


def test_sharded_safetensors_and_bin_checkpoints_load(tmp_path: Path, tiny_dir: Path) -> None:
    expected = _last_logits(tiny_dir)
    model = make_hf_model("llama", tie_word_embeddings=False)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    torch.testing.assert_close(_last_logits(sharded), expected)

    as_bin = _copy_config_only(tiny_dir, tmp_path / "bin")
    torch.save(load_file(tiny_dir / "model.safetensors"), as_bin / "pytorch_model.bin")
    torch.testing.assert_close(_last_logits(as_bin), expected)
