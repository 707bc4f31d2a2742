"""The executor's GrammarCache against a real Redis: what the grammar service cached is loaded
before the request reaches the engine; a missing entry is compiled here."""

from __future__ import annotations

import msgspec
import pytest
import redis.asyncio as aioredis
import xgrammar as xgr

from services.executor.grammar.cache import GrammarCache
from services.grammar.core import GrammarCompiler
from shared import constants
from shared.grammar import GrammarTokenizer
from shared.grammar_store import GrammarStore
from shared.messages.common import ChoiceConstraint, RegexConstraint
from shared.messages.grammar import CompiledGrammarEntry, GrammarCacheEntry
from shared.model_files import resolve_model
from tests.executor.helpers import write_tiny_model

pytestmark = pytest.mark.redis

PHONE = RegexConstraint(pattern=r"\d{3}-\d{4}", param="sampling_params.regex")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> GrammarTokenizer:
    path = write_tiny_model(tmp_path_factory.mktemp("grammar-cache"))
    return GrammarTokenizer.load(resolve_model(str(path)))


async def cache_in_redis(r: aioredis.Redis, compiler: GrammarCompiler, c: RegexConstraint) -> str:
    """What the grammar service does for a constraint; returns its key."""
    key = compiler.key(c)
    await r.set(constants.grammar_cache_key(key), msgspec.msgpack.encode(compiler.compile(c)))
    return key


def accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


async def test_prefetch_loads_what_the_service_cached(
    aredis: aioredis.Redis, tok: GrammarTokenizer
) -> None:
    key = await cache_in_redis(aredis, GrammarCompiler(tok), PHONE)
    cache = GrammarCache(GrammarStore(aredis), tok)
    with pytest.raises(KeyError, match="not prefetched"):
        cache.get(key)
    assert await cache.prefetch(key, PHONE) is None
    assert accepts(cache.get(key), "555-1234") and not accepts(cache.get(key), "5551234")
    assert await cache.prefetch(key, PHONE) is None
    assert (cache.stats.fetched, cache.stats.hits, cache.stats.compiled) == (1, 1, 0)


async def test_a_missing_entry_is_compiled_here_and_stored(
    aredis: aioredis.Redis, tok: GrammarTokenizer
) -> None:
    cache = GrammarCache(GrammarStore(aredis, 60), tok)
    key = GrammarCompiler(tok).key(PHONE)
    assert await cache.prefetch(key, PHONE) is None
    assert accepts(cache.get(key), "555-1234")
    assert cache.stats.compiled == 1
    raw = await aredis.get(constants.grammar_cache_key(key))
    assert isinstance(msgspec.msgpack.decode(raw, type=GrammarCacheEntry), CompiledGrammarEntry)
    assert 0 < await aredis.pttl(constants.grammar_cache_key(key)) <= 60_000


async def test_errors(aredis: aioredis.Redis, tok: GrammarTokenizer) -> None:
    compiler = GrammarCompiler(tok)
    cache = GrammarCache(GrammarStore(aredis), tok)
    missing = await cache.prefetch("no-such-key", None)
    assert missing is not None and missing.status == 503
    bad = RegexConstraint(pattern="(", param="sampling_params.regex")
    refused = await cache.prefetch(await cache_in_redis(aredis, compiler, bad), bad)
    assert refused is not None and refused.status == 400
    assert refused.param == "sampling_params.regex" and "invalid regex" in refused.message
    # A key computed for another tokenizer would load masks for the wrong vocabulary.
    mismatch = await cache.prefetch("0" * 40, PHONE)
    assert mismatch is not None and mismatch.status == 500 and "tokenizers" in mismatch.message


async def test_least_recently_used_grammars_leave_first(
    aredis: aioredis.Redis, tok: GrammarTokenizer
) -> None:
    compiler = GrammarCompiler(tok)
    cache = GrammarCache(GrammarStore(aredis), tok, capacity=2)
    a, b, c = (ChoiceConstraint(choices=[x]) for x in "abc")
    keys = [compiler.key(x) for x in (a, b, c)]
    for key, constraint in zip(keys[:2], (a, b), strict=True):
        assert await cache.prefetch(key, constraint) is None
    cache.get(keys[0])  # a is now more recent than b
    assert await cache.prefetch(keys[2], c) is None
    assert keys[0] in cache and keys[2] in cache and keys[1] not in cache


async def test_an_executor_reading_a_grammar_keeps_it_in_the_store(
    aredis: aioredis.Redis, tok: GrammarTokenizer
) -> None:
    """--grammar-cache-ttl counts from the last use by anyone: an executor's read extends
    the entry's life as the grammar service's do."""
    key = await cache_in_redis(aredis, GrammarCompiler(tok), PHONE)
    await aredis.pexpire(constants.grammar_cache_key(key), 1000)
    cache = GrammarCache(GrammarStore(aredis, 60), tok)
    assert await cache.prefetch(key, PHONE) is None
    assert 1000 < await aredis.pttl(constants.grammar_cache_key(key)) <= 60_000
