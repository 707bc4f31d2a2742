"""The compiled-grammar store in Redis that the grammar service writes and executors read.

One entry per constraint and tokenizer at `rs:gcache:{key}` (see shared.grammar.grammar_key):
a compiled grammar or the compiler's refusal (messages/grammar.py), kept `--grammar-cache-ttl`
seconds after its last use: every read through `get` extends it, whoever reads.
"""

from __future__ import annotations

import logging

import msgspec
import redis.asyncio as aioredis

from shared import constants
from shared.messages.grammar import GrammarCacheEntry

log = logging.getLogger(__name__)


class GrammarStore:
    def __init__(self, r: aioredis.Redis, ttl_s: float = constants.GRAMMAR_CACHE_TTL_S) -> None:
        self.r = r
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._decoder = msgspec.msgpack.Decoder(GrammarCacheEntry)
        self._encoder = msgspec.msgpack.Encoder()

    async def get(self, key: str) -> GrammarCacheEntry | None:
        """The entry of `key`, its lifetime extended; None when absent or unreadable (written
        by another version: the caller compiles again). Redis errors propagate."""
        raw = await self.r.getex(constants.grammar_cache_key(key), px=self.ttl_ms)
        if raw is None:
            return None
        try:
            return self._decoder.decode(raw)
        except msgspec.DecodeError as e:
            log.warning("grammar %s: unreadable cache entry (%s)", key, e)
            return None

    async def put(self, key: str, entry: GrammarCacheEntry) -> None:
        await self.r.set(
            constants.grammar_cache_key(key), self._encoder.encode(entry), px=self.ttl_ms
        )
