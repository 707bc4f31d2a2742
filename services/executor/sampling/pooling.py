"""Embeddings (`--is-embedding`): a request's prompt pooled into one normalised vector.

An embedding request runs as a prefill-only request (max_new_tokens 0): its prompt is
computed, chunk by chunk, and it ends there. The pooled hidden states are the model's final
normed ones, read at the positions pooling needs through the same path as prompt logprobs
(`ForwardBatch.extra_indices`), so nothing else of the step changes:

- "last": the prompt's last token (decoder embedders: gte-Qwen2, e5-mistral); a cached prefix
  is fine, the last token is always computed.
- "mean": every prompt token, summed chunk by chunk in float32 and divided by the prompt's
  length; such a request takes nothing from the prefix cache (`Req.match_limit`), since a
  cached token's hidden state is not computed again.

Under tensor parallelism the final norm is the same on every rank and only rank 0 reads the
pooled positions; the other ranks never see them (no collective depends on them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.executor.errors import UnsupportedModelError
from services.executor.request import Req

POOLINGS = ("last", "mean")


@dataclass
class PoolTargets:
    """Which token positions of an extend step feed an embedding."""

    positions: list[int]  # index along the step's token dimension
    owners: list[tuple[Req, int, bool]]  # (request, positions, whether its prompt ends here)

    @classmethod
    def build(cls, reqs: Sequence[Req], extend_lens: Sequence[int]) -> PoolTargets | None:
        positions: list[int] = []
        owners: list[tuple[Req, int, bool]] = []
        offset = 0
        for req, n in zip(reqs, extend_lens, strict=True):
            if req.pooling is not None:
                start = req.kv_len - n  # the chunk computes positions [start, start + n)
                final = start + n == len(req.input_ids)
                if req.pooling == "mean":
                    if start == 0:  # a fresh prefill (or one recomputed after a retraction)
                        req.pool_sum = None
                    positions += range(offset, offset + n)
                    owners.append((req, n, final))
                elif final:
                    positions.append(offset + n - 1)
                    owners.append((req, 1, True))
            offset += n
        return cls(positions, owners) if positions else None

    def take(self, hidden: torch.Tensor) -> None:
        """`hidden`: the final hidden states at `positions`, in order."""
        at = 0
        for req, count, final in self.owners:
            part = hidden[at : at + count].float().sum(dim=0)
            at += count
            req.pool_sum = part if req.pool_sum is None else req.pool_sum + part
            if final:
                vector = req.pool_sum / (len(req.input_ids) if req.pooling == "mean" else 1)
                if req.dimensions:  # Matryoshka: the first n values, normalised on their own
                    vector = vector[: req.dimensions]
                req.embedding = torch.nn.functional.normalize(vector, dim=0)
                req.pool_sum = None


def pooled_bytes(req: Req) -> bytes | None:
    """The request's embedding on the wire (float32, little-endian), once it is pooled."""
    if req.embedding is None:
        return None
    return req.embedding.to("cpu", torch.float32).numpy().astype("<f4").tobytes()


def model_pooling(model_dir: str, requested: str = "auto") -> str:
    """The pooling `--embedding-pooling` asks for, or with "auto" what the checkpoint
    declares: sentence-transformers' Pooling module (modules.json -> its config.json), and
    last-token pooling for a decoder that declares none. A declared pooling this server does
    not compute (CLS, max, weighted mean) is refused by name."""
    if requested != "auto":
        if requested not in POOLINGS:
            raise ValueError(f"--embedding-pooling must be auto, last or mean, not {requested}")
        return requested
    config = _pooling_config(model_dir)
    if config is None:
        return "last"
    modes = [k.removeprefix("pooling_mode_") for k, v in config.items() if v is True]
    if modes == ["lasttoken"]:
        return "last"
    if modes == ["mean_tokens"]:
        return "mean"
    raise UnsupportedModelError(
        f"the model's pooling ({', '.join(modes) or 'none'}) is not supported; radixserve "
        "pools by the last token or the mean of the tokens (--embedding-pooling last|mean "
        "overrides the model's)"
    )


def matryoshka_dimensions(model_dir: str, hidden_size: int) -> tuple[int, ...]:
    """The lengths an embedding may be cut to (`dimensions`), as the model's config.json
    declares them (vLLM's reading): `matryoshka_dimensions`, or any length with
    `is_matryoshka`; none otherwise."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return ()
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(sorted(int(d) for d in dims if 0 < int(d) <= hidden_size))
    if config.get("is_matryoshka") is True:
        return tuple(range(1, hidden_size + 1))
    return ()


def _pooling_config(model_dir: str) -> dict[str, object] | None:
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    with open(modules_path, encoding="utf-8") as f:
        modules = json.load(f)
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            path = os.path.join(model_dir, m.get("path", ""), "config.json")
            with open(path, encoding="utf-8") as f:
                config: dict[str, object] = json.load(f)
            return config
    return None
