"""Per-request detokenization state and the message handling of one detokenizer partition."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import Struct

from services.detokenizer.incremental import IncrementalDetokenizer
from services.detokenizer.recovery import parse_id
from services.detokenizer.stops import StopStrings
from services.detokenizer.token_text import TokenTexts
from shared.hops import stamp_hops
from shared.messages.common import AbortRequest, ErrorInfo
from shared.messages.detok import (
    DetokMessage,
    DetokRegister,
    LogprobBlock,
    RequestAborted,
    RequestFailed,
    Reroute,
    TokenDelta,
)
from shared.messages.reply import Delta, Failure, TokenLogprob, TopLogprob, Usage
from shared.messages.schedule import RequestDone, TokenizedRequest

log = logging.getLogger(__name__)

# A request is resumed on another executor at most this many times: one that keeps losing its
# executor (perhaps by crashing it) then fails with a retryable 503.
MAX_RESUMES = 2

_request_decoder = msgspec.msgpack.Decoder(TokenizedRequest)

# Finished request ids are remembered this long so late tokens of a stopped request are dropped
# quietly instead of being mistaken for a request that was never registered.
FINISHED_MEMORY_S = 60.0


def logprob_entries(b: LogprobBlock | None, texts: TokenTexts) -> list[TokenLogprob]:
    if b is None:
        return []
    out = []
    for j, (tid, lp) in enumerate(zip(b.token_ids, b.logprobs, strict=True)):
        top = []
        if b.top_ids:
            for alt, alt_lp in zip(b.top_ids[j], b.top_logprobs[j], strict=True):
                t, raw = texts.get(alt)
                top.append(TopLogprob(token_id=alt, token=t, bytes=raw, logprob=alt_lp))
        t, raw = texts.get(tid)
        out.append(TokenLogprob(token_id=tid, token=t, bytes=raw, logprob=lp, top=top))
    return out


# The answer for a request whose registration a new owner of its partition could not find
# (trimmed from the stream while the request was open): the client may simply retry.
LOST_STATE = ErrorInfo(
    status=503,
    message="the detokenizer lost this request's state (its partition changed owner); retry",
    type="server_error",
    retry_after=1,
)


class RequestState:
    def __init__(
        self, reg: DetokRegister, tokenizer: Any, texts: TokenTexts, first_id: str = "0-0"
    ) -> None:
        self.texts = texts
        self.first_id = parse_id(first_id)  # its registration's entry: the low-water mark
        self.echo_text = reg.echo_text
        self.trace = reg.trace
        self.prompt_tokens = reg.prompt_tokens
        self.detok = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=reg.sampling.skip_special_tokens,
            spaces_between_special_tokens=reg.sampling.spaces_between_special_tokens,
        )
        self.stops = StopStrings(
            reg.sampling.stop, reg.sampling.stop_regex, keep=reg.sampling.no_stop_trim
        )
        self.trim_stop_token = not reg.sampling.no_stop_trim
        self.min_tokens = reg.sampling.min_new_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        # Every output token so far: what a request resumed on another executor continues.
        self.output_ids: list[int] = []
        self.fenced: set[str] = set()  # executors it was lost from: their tokens are dropped
        self.registered = time.time()  # its registration was read (the start of its span)

    def on_tokens(self, d: TokenDelta) -> tuple[Delta, bool]:
        """The reply for one step's tokens, and whether a stop string ended the request here."""
        self.completion_tokens += len(d.token_ids)
        self.output_ids += d.token_ids
        self.cached_tokens = max(self.cached_tokens, d.cached_tokens)
        # A matched stop token (EOS or a stop_token_id) ends the output but is not part of it
        # (unless no_stop_trim: then its text is, as SGLang's).
        trimmed = d.matched_stop_token is not None and self.trim_stop_token
        visible = d.token_ids[:-1] if trimmed else d.token_ids
        text = self.detok.push(list(visible))
        if d.finish is not None:
            text += self.detok.flush()
        # Like EOS, stop strings only count once min_new_tokens are out (vLLM's rule).
        if self.completion_tokens < self.min_tokens:
            out, matched = self.stops.pass_through(text), None
        else:
            out, matched = self.stops.feed(text)
        finish: str | None
        stop: str | int | None = None
        if matched is not None:
            finish, stop = "stop", matched
        elif d.finish is not None:
            out += self.stops.flush()
            finish, stop = d.finish, d.matched_stop_token
        else:
            finish = None
        usage = Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
        )
        logprobs = logprob_entries(d.logprobs, self.texts)
        if trimmed and logprobs:  # aligned with the visible text
            logprobs.pop()
        delta = Delta(
            rid=d.rid,
            text=out,
            token_ids=list(d.token_ids),
            usage=usage,
            finish_reason=finish,
            matched_stop=stop,
            logprobs=logprobs,
            prompt_logprobs=logprob_entries(d.prompt_logprobs, self.texts),
            echo_text=self.echo_text,
            embedding=d.embedding,
        )
        self.echo_text = None  # on the first delta only
        return delta, matched is not None and d.finish is None


class Detokenizer:
    """All requests of one partition. `handle` returns the messages to publish, in order."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.states: dict[str, RequestState] = {}
        self.finished: dict[str, float] = {}  # rid -> when it finished
        # While replaying after a takeover: requests the old owner had open (rid -> reply
        # stream) whose registration has not been seen again yet.
        self.orphans: dict[str, str] = {}
        self.unknown = 0  # deltas of requests never registered here (logged, counted)
        self.replaying = False  # replayed entries end requests but never count as unknown
        # Called as a request ends here, with its finish reason ("error": failed): its span
        self.on_finished: Callable[[RequestState, str], None] | None = None

    def handle(
        self, msg: DetokMessage, schedule_stream: str, entry_id: bytes | str = "0-0"
    ) -> list[tuple[str, Struct]]:
        if isinstance(msg, DetokRegister):
            rid = msg.trace.rid
            self.orphans.pop(rid, None)
            if rid not in self.states and rid not in self.finished:  # idempotent on redelivery
                first = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self.states[rid] = RequestState(msg, self.tokenizer, self.texts, first)
            return []
        if isinstance(msg, RequestFailed):
            self.orphans.pop(msg.rid, None)  # ended before the takeover: answered already
            state = self.states.pop(msg.rid, None)
            if state is None:
                return []
            self.finished[msg.rid] = time.monotonic()
            self._ended(state, "error")
            return [
                (state.trace.reply_to, Failure(rid=msg.rid, error=msg.error)),
                (schedule_stream, RequestDone(rid=msg.rid)),
            ]
        if isinstance(msg, RequestAborted):
            # The same ending as an executor's abort before the request's first token.
            ending = TokenDelta(rid=msg.rid, token_ids=[], finish="abort")
            return self._on_deltas([ending], schedule_stream)
        if isinstance(msg, Reroute):
            return self._reroute(msg, schedule_stream)
        return self._on_deltas(msg.deltas, schedule_stream, msg.published or 0.0, msg.executor)

    def _reroute(self, msg: Reroute, schedule_stream: str) -> list[tuple[str, Struct]]:
        """The request's executor is lost: every token it published for the request is
        already here (it published them before the scheduler noticed), so the request goes
        back to the scheduler with that output, to be continued on another executor."""
        state = self.states.get(msg.rid)
        if state is None:
            return []  # it ended first: its answer is out
        state.fenced.add(msg.executor)  # a lost executor that still runs is not heard again
        req = _request_decoder.decode(msg.request)
        if req.resumes >= MAX_RESUMES:
            del self.states[msg.rid]
            self.finished[msg.rid] = time.monotonic()
            err = ErrorInfo(
                status=503,
                message=f"this request lost its executor {req.resumes + 1} times; retry",
                type="server_error",
                retry_after=1,
            )
            return [
                (state.trace.reply_to, Failure(rid=msg.rid, error=err)),
                (schedule_stream, RequestDone(rid=msg.rid)),
            ]
        if not self.replaying:
            log.info(
                "request %s lost executor %s after %d token(s): resuming it elsewhere",
                msg.rid,
                msg.executor,
                len(state.output_ids),
            )
        resumed = msgspec.structs.replace(
            req,
            resume_ids=list(state.output_ids),
            resumes=req.resumes + 1,
            avoid=[*req.avoid, msg.executor],
        )
        return [(schedule_stream, resumed)]

    def _on_deltas(
        self,
        deltas: list[TokenDelta],
        schedule_stream: str,
        published: float = 0.0,
        executor: str = "",
    ) -> list[tuple[str, Struct]]:
        out: list[tuple[str, Struct]] = []
        for d in deltas:
            state = self.states.get(d.rid)
            if state is None:
                self._unknown(d)
                continue
            if executor in state.fenced:
                continue  # from an executor it was lost from (it lives on): resumed elsewhere
            reply, stopped_here = state.on_tokens(d)
            if d.hops is not None:  # the first delta: the executor's publication time too
                hops = stamp_hops(d.hops, executor_published=published)
                reply = msgspec.structs.replace(reply, hops=hops)
            out.append((state.trace.reply_to, reply))
            if reply.finish_reason is not None:
                del self.states[d.rid]
                self.finished[d.rid] = time.monotonic()
                self._ended(state, reply.finish_reason)
                out.append((schedule_stream, RequestDone(rid=d.rid)))
            if stopped_here:  # the executor is still generating: stop it and free its KV
                out.append((schedule_stream, AbortRequest(rid=d.rid, reason="stop")))
        return out

    def _ended(self, state: RequestState, finish: str) -> None:
        if self.on_finished is not None and not self.replaying:
            self.on_finished(state, finish)

    @staticmethod
    def stamp_published(out: list[tuple[str, Struct]], now: float) -> list[tuple[str, Struct]]:
        """`out` with the first deltas' `detok_published` set, as the service publishes it."""
        return [
            (
                s,
                msgspec.structs.replace(m, hops=stamp_hops(m.hops, detok_published=now))
                if isinstance(m, Delta) and m.hops is not None
                else m,
            )
            for s, m in out
        ]

    def _unknown(self, d: TokenDelta) -> None:
        if d.finish is not None:
            self.orphans.pop(d.rid, None)  # it ended before the takeover: answered already
        if self.replaying or d.rid in self.finished or d.rid in self.orphans:
            return  # late tokens of a request a stop string ended; an orphan fails later
        # Its registration always precedes its tokens on this stream, and a takeover replays
        # from the oldest open request's: an id seen nowhere finished before that mark.
        self.unknown += 1
        self.finished[d.rid] = time.monotonic()  # say so once per request
        log.warning("tokens for request %s, which this partition does not know; dropped", d.rid)

    def low_water(self) -> tuple[int, int] | None:
        """The first entry of the oldest open request (None: none is open)."""
        return min((s.first_id for s in self.states.values()), default=None)

    def open_replies(self) -> dict[str, str]:
        return {rid: s.trace.reply_to for rid, s in self.states.items()}

    def fail_orphans(self, schedule_stream: str) -> list[tuple[str, Struct]]:
        """After a replay: the requests the old owner had open that the replay did not find
        (their registration was trimmed away) fail with a retryable 503 instead of hanging."""
        out: list[tuple[str, Struct]] = []
        for rid, reply_to in self.orphans.items():
            log.warning("request %s: registration trimmed before a takeover; failing it", rid)
            out.append((reply_to, Failure(rid=rid, error=LOST_STATE)))
            out.append((schedule_stream, RequestDone(rid=rid)))
            self.finished[rid] = time.monotonic()
        self.orphans.clear()
        return out

    def forget_all(self) -> None:
        """Drop every request (their callers were told to retry)."""
        self.states.clear()
        self.finished.clear()
        self.orphans.clear()

    def expire(self, now_wall: float | None = None) -> None:
        """Drop requests whose deadline passed (the gateway has given up on them)."""
        now_wall = time.time() if now_wall is None else now_wall
        for rid, state in list(self.states.items()):
            if state.trace.deadline < now_wall:
                del self.states[rid]
                self.finished[rid] = time.monotonic()
        cutoff = time.monotonic() - FINISHED_MEMORY_S
        for rid, t in list(self.finished.items()):
            if t < cutoff:
                del self.finished[rid]
