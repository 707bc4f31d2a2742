"""The grammar service against a real Redis: compile, cache hits, refusals, shared cache."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import xgrammar as xgr

from services.grammar.core import GrammarCompiler
from services.grammar.main import TIMEOUT_REFUSAL_HOLDS_S, GrammarWorker
from shared import constants
from shared.bus import publish
from shared.grammar import GrammarTokenizer, load_compiled
from shared.messages.common import (
    ChoiceConstraint,
    Constraint,
    EbnfConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    Trace,
)
from shared.messages.detok import DetokMessage, RequestFailed
from shared.messages.grammar import CompiledGrammarEntry, GrammarCacheEntry, GrammarErrorEntry
from shared.messages.reply import Failure, ReplyMessage
from shared.messages.schedule import ScheduleMessage, TokenizedRequest
from shared.model_files import resolve_model
from tests.executor.helpers import EOS_ID, write_tiny_model

pytestmark = pytest.mark.redis

REPLY = "rs:reply:test"
DETOK = constants.detok_stream(0)
SCHEMA = JsonSchemaConstraint(
    schema=json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
            "required": ["a", "b"],
        }
    ),
    param="response_format.json_schema.schema",
)

MUTUAL_REFS = json.dumps(
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
)
DEEP = '{"items": ' * 5000 + "{}" + "}" * 5000  # deeper than Python's recursion limit

Start = Callable[[str], Awaitable[GrammarWorker]]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> GrammarTokenizer:
    path = write_tiny_model(tmp_path_factory.mktemp("grammar-service"))
    return GrammarTokenizer.load(resolve_model(str(path)))


@pytest.fixture
async def start_worker(aredis: aioredis.Redis, tok: GrammarTokenizer) -> AsyncIterator[Start]:
    """Start in-process grammar service instances; stop() them all at the end."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(name: str) -> GrammarWorker:
        worker = GrammarWorker.on(aredis, GrammarCompiler(tok), name, threads=2, cache_ttl_s=60)
        stopping = asyncio.Event()
        running.append((stopping, asyncio.create_task(worker.run(stopping))))
        return worker

    yield start
    for stopping, task in running:
        stopping.set()
        await asyncio.wait_for(task, 10)


async def stop(worker_task: tuple[asyncio.Event, asyncio.Task[None]]) -> None:
    worker_task[0].set()
    await asyncio.wait_for(worker_task[1], 10)


def request(
    constraint: Constraint, rid: str | None = None, deadline: float = 1e12
) -> TokenizedRequest:
    return TokenizedRequest(
        trace=Trace(rid=rid or uuid.uuid4().hex, reply_to=REPLY, deadline=deadline),
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=8),
        max_new_tokens=8,
        eos_token_ids=[EOS_ID],
        detok_stream=DETOK,
        constraint=constraint,
    )


async def submit(r: aioredis.Redis, *reqs: TokenizedRequest) -> None:
    for req in reqs:
        await publish(r, constants.GRAMMAR_STREAM, req)


async def read_stream(r: aioredis.Redis, stream: str, type_: Any) -> list[Any]:
    decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(type_)
    return [decoder.decode(fields[b"m"]) for _, fields in await r.xrange(stream)]


async def wait_for(
    r: aioredis.Redis, stream: str, type_: Any, rid: str, timeout: float = 20.0
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for msg in await read_stream(r, stream, type_):
            if getattr(msg, "rid", None) == rid or (
                isinstance(msg, TokenizedRequest) and msg.trace.rid == rid
            ):
                return msg
        await asyncio.sleep(0.02)
    raise AssertionError(f"nothing for {rid} on {stream} within {timeout}s")


async def test_compiles_once_then_hits_the_cache(
    aredis: aioredis.Redis, start_worker: Start, tok: GrammarTokenizer
) -> None:
    worker = await start_worker("g1")
    first, second = request(SCHEMA, "first"), request(SCHEMA, "second")
    await submit(aredis, first)
    out = await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, "first")
    key = worker.compiler.key(SCHEMA)
    assert out == msgspec.structs.replace(first, grammar_key=key)
    assert (worker.stats.compiled, worker.stats.cache_hits) == (1, 0)

    await submit(aredis, second)
    out = await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, "second")
    assert isinstance(out, TokenizedRequest) and out.grammar_key == key
    assert (worker.stats.compiled, worker.stats.cache_hits, worker.stats.requests) == (1, 1, 2)

    # What the executor loads from the cache is the compiled schema.
    raw = await aredis.get(constants.grammar_cache_key(key))
    entry = msgspec.msgpack.decode(raw, type=GrammarCacheEntry)
    assert isinstance(entry, CompiledGrammarEntry) and entry.kind == "json_schema"
    matcher = xgr.GrammarMatcher(load_compiled(entry.data, tok))
    assert matcher.accept_string('{"a": 12, "b": "y"}') and matcher.is_completed()
    assert await aredis.pttl(constants.grammar_cache_key(key)) > 0  # entries expire unused
    assert await read_stream(aredis, REPLY, ReplyMessage) == []
    await asyncio.sleep(0.1)
    assert (await aredis.xpending(constants.GRAMMAR_STREAM, constants.GRAMMAR_GROUP))[
        "pending"
    ] == 0


NO_OUTPUT_OR_CYCLE = r"accepts no output|Circular \$ref chain"


@pytest.mark.parametrize(
    ("constraint", "reason"),
    [
        (JsonSchemaConstraint(schema='{"type": "foo"}'), 'Unsupported type "foo"'),
        (JsonSchemaConstraint(schema='{"type": "object",'), "is not valid JSON"),
        (JsonSchemaConstraint(schema="[1, 2]"), "must be an object or a boolean"),
        (RegexConstraint(pattern="a(b", param="sampling_params.regex"), "not closed"),
        (EbnfConstraint(grammar="root ::= foo"), 'Rule "foo" is not defined'),
        (EbnfConstraint(grammar='start ::= "a"'), "root"),
        # The crashers: xgrammar compiles each, yet no output satisfies any of them.
        (RegexConstraint(pattern="[^\\s\\S]", param="regex"), "accepts no output"),
        (EbnfConstraint(grammar="root ::= root", param="ebnf"), "accepts no output"),
        # (xgrammar 0.2.9 refuses these two itself: "Circular $ref chain with no schema content")
        (JsonSchemaConstraint(schema='{"$ref": "#"}', param="json_schema"), NO_OUTPUT_OR_CYCLE),
        (JsonSchemaConstraint(schema=MUTUAL_REFS, param="json_schema"), NO_OUTPUT_OR_CYCLE),
        (JsonSchemaConstraint(schema=DEEP, param="json_schema"), "nested too deeply"),
    ],
)
async def test_invalid_constraint_is_a_400_with_the_compiler_reason(
    aredis: aioredis.Redis, start_worker: Start, constraint: Constraint, reason: str
) -> None:
    worker = await start_worker("g1")
    await submit(aredis, request(constraint, "bad"))
    failure = await wait_for(aredis, REPLY, ReplyMessage, "bad")
    assert isinstance(failure, Failure)
    assert failure.error.status == 400 and failure.error.param == constraint.param
    assert re.search(reason, failure.error.message), failure.error.message
    assert "/project/cpp" not in failure.error.message  # xgrammar's log prefix is gone
    dropped = await wait_for(aredis, DETOK, DetokMessage, "bad")
    assert dropped == RequestFailed(rid="bad", error=failure.error)
    assert await read_stream(aredis, constants.SCHEDULE_STREAM, ScheduleMessage) == []
    assert worker.stats.compile_errors == 1

    # The refusal is cached: the same constraint again fails without compiling.
    await submit(aredis, request(constraint, "bad-again"))
    again = await wait_for(aredis, REPLY, ReplyMessage, "bad-again")
    assert isinstance(again, Failure) and again.error.message == failure.error.message
    assert (worker.stats.compile_errors, worker.stats.cache_hits) == (1, 1)
    key = worker.compiler.key(constraint)
    entry = msgspec.msgpack.decode(
        await aredis.get(constants.grammar_cache_key(key)), type=GrammarCacheEntry
    )
    assert isinstance(entry, GrammarErrorEntry)


async def test_every_kind_compiles_and_is_forwarded(
    aredis: aioredis.Redis, start_worker: Start
) -> None:
    worker = await start_worker("g1")
    constraints: list[Constraint] = [
        SCHEMA,
        JsonSchemaConstraint(schema='{"type": "object"}', param="response_format"),
        RegexConstraint(pattern=r"\d{3}-\d{4}"),
        EbnfConstraint(grammar='root ::= "a" root | "b"'),
        ChoiceConstraint(choices=['say "hi"', "naïve", "a\\b"]),
    ]
    reqs = [request(c, f"kind-{i}") for i, c in enumerate(constraints)]
    await submit(aredis, *reqs)
    for req in reqs:
        out = await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, req.trace.rid)
        assert isinstance(out, TokenizedRequest)
        assert out.grammar_key == worker.compiler.key(req.constraint)  # type: ignore[arg-type]
    assert worker.stats.compiled == len(constraints)
    assert len({worker.compiler.key(c) for c in constraints}) == len(constraints)


async def test_concurrent_requests_share_one_compile(
    aredis: aioredis.Redis, start_worker: Start
) -> None:
    worker = await start_worker("g1")
    reqs = [request(SCHEMA, f"burst-{i}") for i in range(6)]
    await submit(aredis, *reqs)
    for req in reqs:
        await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, req.trace.rid)
    assert worker.stats.compiled == 1 and worker.stats.cache_hits == 5


async def test_two_instances_share_the_cache(aredis: aioredis.Redis, tok: GrammarTokenizer) -> None:
    first = GrammarWorker.on(aredis, GrammarCompiler(tok), "g1")
    stopping = asyncio.Event()
    task = asyncio.create_task(first.run(stopping))
    await submit(aredis, request(SCHEMA, "on-first"))
    await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, "on-first")
    await stop((stopping, task))
    assert first.stats.compiled == 1

    # Another replica (its own compiler, its own process in production) finds it compiled.
    second = GrammarWorker.on(aredis, GrammarCompiler(tok), "g2")
    stopping = asyncio.Event()
    task = asyncio.create_task(second.run(stopping))
    await submit(aredis, request(SCHEMA, "on-second"))
    out = await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, "on-second")
    await stop((stopping, task))
    assert isinstance(out, TokenizedRequest) and out.grammar_key == first.compiler.key(SCHEMA)
    assert (second.stats.compiled, second.stats.cache_hits) == (0, 1)


async def test_expired_request_is_a_504(aredis: aioredis.Redis, start_worker: Start) -> None:
    worker = await start_worker("g1")
    await submit(aredis, request(SCHEMA, "late", deadline=time.time() - 1))
    failure = await wait_for(aredis, REPLY, ReplyMessage, "late")
    assert isinstance(failure, Failure) and failure.error.status == 504
    assert isinstance(await wait_for(aredis, DETOK, DetokMessage, "late"), RequestFailed)
    assert worker.stats.requests == 0  # nothing was looked up or compiled


def test_keys_depend_on_kind_source_and_tokenizer(tok: GrammarTokenizer, tmp_path: Path) -> None:
    compiler = GrammarCompiler(tok)
    same = JsonSchemaConstraint(schema=SCHEMA.schema, param="sampling_params.json_schema")
    assert compiler.key(SCHEMA) == compiler.key(same)  # where it came from does not matter
    assert compiler.key(RegexConstraint(pattern="a")) != compiler.key(EbnfConstraint(grammar="a"))
    other = GrammarTokenizer.load(resolve_model(str(write_tiny_model(tmp_path, vocab_size=300))))
    assert GrammarCompiler(other).key(SCHEMA) != compiler.key(SCHEMA)


async def test_a_grammar_gone_from_redis_is_stored_again(
    aredis: aioredis.Redis, start_worker: Start
) -> None:
    """Executors load compiled grammars from Redis: when the entry expired there, an answer
    from the instance's own memory puts it back."""
    worker = await start_worker("g1")
    await submit(aredis, request(SCHEMA, "first"))
    await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, "first")
    key = constants.grammar_cache_key(worker.compiler.key(SCHEMA))
    assert await aredis.delete(key) == 1
    await submit(aredis, request(SCHEMA, "after-expiry"))
    out = await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, "after-expiry")
    assert isinstance(out, TokenizedRequest)
    assert await aredis.exists(key) == 1
    assert worker.stats.compiled == 1


class StuckCompiler(GrammarCompiler):
    """Compiles like the real one, except that one source never finishes until released."""

    def __init__(self, tok: GrammarTokenizer, stuck: str) -> None:
        super().__init__(tok)
        self.stuck, self.release = stuck, threading.Event()

    def compile(self, c: Constraint) -> GrammarCacheEntry:
        if isinstance(c, RegexConstraint) and c.pattern == self.stuck:
            self.release.wait(30)
        return super().compile(c)


async def test_a_compile_past_the_timeout_is_a_400_and_others_go_on(
    aredis: aioredis.Redis, tok: GrammarTokenizer
) -> None:
    compiler = StuckCompiler(tok, "a+")
    worker = GrammarWorker.on(aredis, compiler, "g1", threads=1, compile_timeout_s=0.5)
    stopping = asyncio.Event()
    task = asyncio.create_task(worker.run(stopping))
    try:
        slow = RegexConstraint(pattern="a+", param="regex")
        await submit(aredis, request(slow, "slow"))
        failure = await wait_for(aredis, REPLY, ReplyMessage, "slow")
        assert isinstance(failure, Failure) and failure.error.status == 400
        assert failure.error.param == "regex" and "longer than 0.5 s" in failure.error.message
        # The stuck thread holds no place: the next compile (pool of one) goes through.
        await submit(aredis, request(SCHEMA, "next"))
        out = await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, "next")
        assert isinstance(out, TokenizedRequest) and out.grammar_key
        # And the refusal is cached for a while: the same constraint again is refused at once.
        await submit(aredis, request(slow, "slow-again"))
        again = await wait_for(aredis, REPLY, ReplyMessage, "slow-again")
        assert isinstance(again, Failure) and again.error.message == failure.error.message
        # Once it lapses (a slow compile may have been starved, not bad), the grammar is
        # compiled again: the stored refusal says until when it holds.
        key = worker.compiler.key(slow)
        stored = await worker.store.get(key)
        assert isinstance(stored, GrammarErrorEntry)
        assert 0 < stored.until - time.time() <= TIMEOUT_REFUSAL_HOLDS_S
        await worker.store.put(key, msgspec.structs.replace(stored, until=time.time() - 1))
        compiler.release.set()
        await submit(aredis, request(slow, "slow-later"))
        later = await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, "slow-later")
        assert isinstance(later, TokenizedRequest) and later.grammar_key
    finally:
        compiler.release.set()
        stopping.set()
        await asyncio.wait_for(task, 10)
        worker.close()


class SteadyCompiler(GrammarCompiler):
    """Compiles like the real one, each compile taking `seconds` of its thread's time."""

    def __init__(self, tok: GrammarTokenizer, seconds: float) -> None:
        super().__init__(tok)
        self.seconds = seconds

    def compile(self, c: Constraint) -> GrammarCacheEntry:
        time.sleep(self.seconds)  # the compile's own duration, as a slow schema's would be
        return super().compile(c)


async def test_compiles_waiting_for_a_thread_are_not_timed_out(
    aredis: aioredis.Redis, tok: GrammarTokenizer
) -> None:
    """Six distinct grammars at once on one thread, each compiling in 0.3 s under a 0.5 s
    timeout: the later ones wait 1.5 s for the thread, and that wait is not the grammar's
    (it was: under load, valid schemas were refused, and the refusal cached)."""
    worker = GrammarWorker.on(
        aredis, SteadyCompiler(tok, 0.3), "g1", threads=1, compile_timeout_s=0.5
    )
    stopping = asyncio.Event()
    task = asyncio.create_task(worker.run(stopping))
    try:
        reqs = [
            request(RegexConstraint(pattern=f"a{i}+", param="regex"), f"r{i}") for i in range(6)
        ]
        await submit(aredis, *reqs)
        for i in range(6):
            out = await wait_for(aredis, constants.SCHEDULE_STREAM, ScheduleMessage, f"r{i}")
            assert isinstance(out, TokenizedRequest) and out.grammar_key
        assert worker.stats.compile_errors == 0
    finally:
        stopping.set()
        await asyncio.wait_for(task, 10)
        worker.close()
