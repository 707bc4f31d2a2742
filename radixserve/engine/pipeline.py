"""The whole engine in one process: the tokenizer's, the executor's and the detokenizer's
synchronous cores, wired by queues instead of Redis streams.

    pipeline = Pipeline(tokenization, engine, grammar_tok)
    rids = pipeline.submit(jobs, sinks)     # any thread: validated jobs in
    # each sink's `put` hears its request's replies (Delta / Failure), in order

One stepping thread owns the executor's engine and the detokenizer: it takes the submitted
requests (registering each with the detokenizer first, so a registration always precedes its
tokens), steps the engine while it has work, and turns each step's tokens into text for the
callers' sinks. On a GPU that detokenization runs after the next step is launched, so it is
hidden behind the device's work, as the executor's own bookkeeping is; a second thread would
only contend with the stepping one for the GIL. Callers only ever touch their sinks and the
inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import xgrammar as xgr
from msgspec import Struct

from services.detokenizer.core import Detokenizer
from services.executor.engine.loop import Engine as StepEngine
from services.gateway.responses import Accumulated
from services.gateway.validation import Job
from services.tokenizer.core import PromptError, Tokenization
from services.tokenizer.handlers import generate as tokenize_request
from shared.grammar import (
    GrammarError,
    GrammarTokenizer,
    compile_constraint,
    grammar_key,
    new_compiler,
)
from shared.messages.common import AbortRequest, ErrorInfo, Trace
from shared.messages.detok import DetokRegister
from shared.messages.reply import Delta, Failure
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import GenerateRequest
from shared.request_ids import request_ids

log = logging.getLogger(__name__)

DEADLINE_S = 24 * 3600.0  # no HTTP timeout in-process: a day, then the engine gives up
REPLY = "inproc"  # the reply_to of every in-process request (replies are routed by rid)
EXPIRE_EVERY_S = 10.0  # how often the engine lets the detokenizer forget finished rids

Reply = Delta | Failure


class RequestError(ValueError):
    """A request refused before it ran, with the message and field an HTTP 400 would name."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info
        self.param = info.param


@dataclass
class Sink:
    """Where one request's replies go, called from the stepping thread. With `collect`,
    the deltas are added to `acc` there and `put` hears only the last one (a caller that
    wants the whole result is woken once, not once a token)."""

    put: Callable[[Reply], None]
    rid: str = ""  # the caller's name for the request
    key: str = ""  # the id it runs under (shared/request_ids.py)
    collect: bool = False
    acc: Accumulated = field(default_factory=Accumulated)


@dataclass
class _Control:
    request: TokenizedRequest | None = None
    register: DetokRegister | None = None  # the request's, handled just before it
    abort: str | None = None
    flush: threading.Event | None = None
    flushed: list[bool] = field(default_factory=list)


class Pipeline:
    def __init__(
        self, tokenization: Tokenization, engine: StepEngine, grammar_tok: GrammarTokenizer
    ) -> None:
        self.tok, self.engine, self.grammar_tok = tokenization, engine, grammar_tok
        self.detok = Detokenizer(tokenization.tokenizer)
        self.compiled: dict[str, xgr.CompiledGrammar] = {}  # read by the engine's grammars
        self._compiler: xgr.GrammarCompiler | None = None
        self._compile_lock = threading.Lock()
        self.sinks: dict[str, Sink] = {}  # key -> the sink of the request running under it
        self.keys: dict[str, str] = {}  # rid -> key, of the requests in flight
        self._sinks_lock = threading.Lock()
        self.inbox: queue.SimpleQueue[_Control] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.failure: BaseException | None = None
        self._expired_at = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
        self.thread.start()

    # -- any thread --------------------------------------------------------------------------
    def submit(self, jobs: Sequence[Job], sinks: Sequence[Sink]) -> list[str]:
        """Tokenize and start every job (all or none: a refusal raises RequestError before any
        starts); their rids."""
        self._check_alive()
        ids = [request_ids(job.rid) for job in jobs]
        rids, keys = [rid for rid, _ in ids], [key for _, key in ids]
        with self._sinks_lock:  # reserve the rids, so a concurrent call cannot take one
            for rid in rids:
                if rid in self.keys or rids.count(rid) > 1:
                    info = ErrorInfo(
                        status=400, message=f"rid {rid!r} is already in flight", param="rid"
                    )
                    raise RequestError(info)
            self.keys.update(zip(rids, keys, strict=True))
        try:
            prepared = [self._prepare(job, key) for job, key in zip(jobs, keys, strict=True)]
        except BaseException:
            with self._sinks_lock:
                for rid in rids:
                    del self.keys[rid]
            raise
        for (register, request), sink, rid, key in zip(prepared, sinks, rids, keys, strict=True):
            sink.rid, sink.key = rid, key
            with self._sinks_lock:
                self.sinks[key] = sink
            self.inbox.put(_Control(request=request, register=register))
        self._wake.set()
        return rids

    def abort(self, rid: str) -> bool:
        """Stop a request in flight (it ends with finish reason "abort"); False if unknown."""
        with self._sinks_lock:
            key = self.keys.get(rid)
        if key is not None:
            self.inbox.put(_Control(abort=key))
            self._wake.set()
        return key is not None

    def flush_cache(self, timeout_s: float = 60.0) -> bool:
        """Empty the prefix cache; False while requests run (they hold cached prefixes)."""
        self._check_alive()
        control = _Control(flush=threading.Event())
        self.inbox.put(control)
        self._wake.set()
        assert control.flush is not None
        if not control.flush.wait(timeout_s):
            raise TimeoutError("the engine did not answer the cache flush")
        return bool(control.flushed and control.flushed[0])

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout_s)

    def release(self) -> None:
        """Drop the step engine, and with it the model, the KV pool and the CUDA graphs, once
        the stepping thread has stopped (the only reader of `engine`)."""
        if not self.thread.is_alive() and hasattr(self, "engine"):
            del self.engine

    def in_flight(self) -> int:
        with self._sinks_lock:
            return len(self.sinks)

    # -- the caller's thread: tokenization and grammars, as the services do them -------------
    def _prepare(self, job: Job, key: str) -> tuple[DetokRegister, TokenizedRequest]:
        trace = Trace(rid=key, reply_to=REPLY, deadline=time.time() + DEADLINE_S)
        req = GenerateRequest(
            trace=trace,
            prompt=job.prompt,
            sampling=job.sampling,
            stream=job.stream,
            constraint=job.constraint,
            echo=job.echo,
            api=job.api,
            embed=job.embed,
            dimensions=job.dimensions,
        )
        try:
            (_, register), (_, tokenized) = tokenize_request(self.tok, req, partitions=1)
        except PromptError as e:
            raise RequestError(e.info) from None
        assert isinstance(register, DetokRegister) and isinstance(tokenized, TokenizedRequest)
        if tokenized.constraint is not None:
            key = self._grammar(tokenized)
            tokenized = msgspec.structs.replace(tokenized, grammar_key=key)
        return register, tokenized

    def _grammar(self, req: TokenizedRequest) -> str:
        c = req.constraint
        assert c is not None
        key = grammar_key(c, self.grammar_tok.fingerprint)
        with self._compile_lock:
            if key in self.compiled:
                return key
            if self._compiler is None:
                self._compiler = new_compiler(self.grammar_tok)
            try:
                self.compiled[key] = compile_constraint(self._compiler, c)
            except GrammarError as e:
                raise RequestError(ErrorInfo(status=400, message=str(e), param=c.param)) from None
        return key

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the engine stopped after a failure: {self.failure!r}")
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")

    # -- the stepping thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_inbox()
                self._forget_finished()
                if not self.engine.has_work():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for _, out in self.engine.step().outputs:
                    self._deliver(self.detok.handle(out, "", "0-0"))
        except BaseException as e:  # a bug, or the device gone: every caller hears it
            self._failed(e, "the engine's stepping thread")

    def _forget_finished(self) -> None:
        """The detokenizer remembers finished rids for a while (to drop late tokens quietly);
        let it forget them now and then, as the service does, so a long-lived engine does
        not grow."""
        now = time.monotonic()
        if now - self._expired_at > EXPIRE_EVERY_S:
            self._expired_at = now
            self.detok.expire()

    def _failed(self, e: BaseException, where: str) -> None:
        self.failure = e
        log.exception("%s failed", where)
        info = ErrorInfo(status=500, message=f"the engine failed: {e!r}", type="server_error")
        with self._sinks_lock:
            sinks = list(self.sinks.values())
            self.sinks.clear()
            self.keys.clear()
        for sink in sinks:
            sink.put(Failure(rid=sink.rid, error=info))

    def _take_inbox(self) -> None:
        while True:
            try:
                c = self.inbox.get_nowait()
            except queue.Empty:
                return
            if c.request is not None:
                if c.register is not None:  # before the engine can produce a token for it
                    self.detok.handle(c.register, "", "0-0")
                self.engine.submit(c.request)
            elif c.abort is not None:
                self.engine.submit(AbortRequest(rid=c.abort))
            elif c.flush is not None:
                c.flushed.append(not self.engine.has_work() and self.engine.flush_cache())
                c.flush.set()

    def _deliver(self, messages: list[tuple[str, Struct]]) -> None:
        for _, m in messages:
            if isinstance(m, AbortRequest):  # a stop string matched: the executor stops it
                self.engine.submit(m)
            elif isinstance(m, Delta | Failure):
                with self._sinks_lock:
                    sink = self.sinks.get(m.rid)
                    if sink is not None and (isinstance(m, Failure) or m.finish_reason is not None):
                        del self.sinks[m.rid]
                        del self.keys[sink.rid]
                if sink is None:
                    continue
                if sink.key != sink.rid:  # the caller knows it by its own rid
                    m = msgspec.structs.replace(m, rid=sink.rid)
                if sink.collect and isinstance(m, Delta):
                    sink.acc.add(m)
                    if m.finish_reason is None:
                        continue
                sink.put(m)
            # RequestDone and the like: for a scheduler, which this process has none of
