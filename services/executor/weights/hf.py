"""Reading HF checkpoints: safetensors (mmap'd, one tensor at a time) or pytorch_model*.bin."""

from __future__ import annotations

import glob
import json
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from services.executor.errors import ModelLoadError


def hf_weight_files(model_dir: str) -> list[str]:
    """The checkpoint's weight files, safetensors preferred, shards in index order."""
    for index_name, pattern in (
        ("model.safetensors.index.json", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        index_path = os.path.join(model_dir, index_name)
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map: dict[str, str] = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ModelLoadError(f"cannot read weight index {index_path}: {e}") from e
            return [os.path.join(model_dir, name) for name in dict.fromkeys(weight_map.values())]
        files = sorted(glob.glob(os.path.join(model_dir, pattern)))
        if files:
            return files
    raise ModelLoadError(f"no weights (*.safetensors or pytorch_model*.bin) in {model_dir}")


class SafetensorsSlice:
    """A tensor of an open safetensors file, read (in part) only when asked."""

    def __init__(self, part: Any) -> None:
        self.part = part

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.part.get_shape())

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.part[index] if index else self.part[:]


def iter_hf_weights(files: list[str]) -> Iterator[tuple[str, SafetensorsSlice | torch.Tensor]]:
    """(HF name, tensor) for every tensor of every file, one file open at a time: a
    safetensors tensor is read when its part is asked for (loader.py), a .bin's is mmap'd."""
    for path in files:
        if path.endswith(".safetensors"):
            yield from _iter_safetensors(path)
        else:
            yield from _iter_bin(path)


def _iter_safetensors(path: str) -> Iterator[tuple[str, SafetensorsSlice]]:
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, SafetensorsSlice(f.get_slice(name))
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"cannot read weights file {path}: {e}") from e


def _iter_bin(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        # mmap: tensors are paged in as they are copied into the model, not all at once.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ModelLoadError(f"cannot read weights file {path}: {e}") from e
    yield from state.items()
