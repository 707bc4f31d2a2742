"""The model's tokenizer as the zip SMG's GetTokenizer streams: the files `save_pretrained`
writes (tokenizer.json, tokenizer_config.json with the chat template, special tokens), plus
the checkpoint's generation_config.json when it has one. Built once, from the same
`load_tokenizer` the tokenizer service uses, so a GGUF's embedded tokenizer is exported too."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass

from services.gateway.errors import ApiError
from shared.model_files import ModelNotFoundError, ModelSource, load_tokenizer, resolve_model

CHUNK_BYTES = 1 << 20  # a message well under SMG's (and gRPC's default) 4 MiB limit


@dataclass(frozen=True)
class TokenizerZip:
    data: bytes
    sha256: str

    def chunks(self) -> list[bytes]:
        return [self.data[i : i + CHUNK_BYTES] for i in range(0, len(self.data), CHUNK_BYTES)]


def build(source: ModelSource) -> TokenizerZip:
    tokenizer = load_tokenizer(source)
    with tempfile.TemporaryDirectory(prefix="radixserve-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        generation = os.path.join(source.directory, "generation_config.json")
        if source.kind == "hf" and os.path.isfile(generation):
            shutil.copy(generation, tmp)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for name in sorted(os.listdir(tmp)):
                # a fixed timestamp: the same tokenizer always gives the same bytes and digest
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                with open(os.path.join(tmp, name), "rb") as f:
                    z.writestr(info, f.read())
    data = buf.getvalue()
    return TokenizerZip(data, hashlib.sha256(data).hexdigest())


class TokenizerZips:
    """The bundle of the gateway's model, built on first use in a worker thread (loading a
    tokenizer takes a while: the event loop serves on meanwhile) and kept."""

    def __init__(self, model_path: str, served_name: str) -> None:
        self.model_path, self.served_name = model_path, served_name
        self._lock = asyncio.Lock()
        self._zip: TokenizerZip | None = None

    async def get(self) -> TokenizerZip:
        async with self._lock:
            if self._zip is None:
                self._zip = await asyncio.to_thread(self._build)
        return self._zip

    def _build(self) -> TokenizerZip:
        try:
            return build(resolve_model(self.model_path, self.served_name))
        except ModelNotFoundError as e:  # the gateway's host cannot read the model's files
            raise ApiError(412, f"this gateway cannot read the model's tokenizer files: {e}") from e
