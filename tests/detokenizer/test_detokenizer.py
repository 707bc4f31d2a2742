"""Incremental detokenization and the partition's message handling, with a real tokenizer."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from services.detokenizer.core import Detokenizer
from services.detokenizer.incremental import IncrementalDetokenizer
from shared.messages.common import AbortRequest, HopTimes, SamplingParams, Trace
from shared.messages.detok import DetokRegister, RequestAborted, Reroute, StepOutput, TokenDelta
from shared.messages.reply import Delta, Failure, Usage
from shared.messages.schedule import RequestDone, TokenizedRequest
from tests.executor.helpers import EOS_ID, make_tokenizer

TEXTS = ["hello world", "héllo 世界 — ok", "emoji 🙂🙃 end", "the thin thing in the"]


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode_and_never_breaks_utf8(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # Multi-byte characters span several byte tokens: some pushes must have waited.
    if any(ord(c) > 127 for c in text):
        assert "" in pieces[:-1]


def test_special_tokens_are_skipped_or_kept(tok: Any) -> None:
    ids = [*tok.encode("hi", add_special_tokens=False), EOS_ID]
    assert "".join(IncrementalDetokenizer(tok).push(ids)) == "hi"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False).push(ids)
    assert kept.endswith("<|im_end|>")


def register(rid: str, **sp: object) -> DetokRegister:
    return DetokRegister(
        trace=Trace(rid=rid, reply_to=f"reply:{rid}", deadline=1e12),
        prompt_tokens=5,
        sampling=SamplingParams(**sp),  # type: ignore[arg-type]
    )


def step(*deltas: TokenDelta) -> StepOutput:
    return StepOutput(executor="e", step=0, deltas=list(deltas))


def test_stop_string_finishes_and_aborts_the_executor(tok: Any) -> None:
    d = Detokenizer(tok)
    d.handle(register("a", stop=["in"]), "sched")
    ids = tok.encode("the thing", add_special_tokens=False)
    out = []
    for i in ids:
        out += d.handle(step(TokenDelta(rid="a", token_ids=[i])), "sched")
    replies = [m for s, m in out if s == "reply:a"]
    assert all(isinstance(m, Delta) for m in replies)
    assert "".join(m.text for m in replies if isinstance(m, Delta)) == "the th"
    last = replies[-1]
    assert isinstance(last, Delta) and last.finish_reason == "stop" and last.matched_stop == "in"
    assert ("sched", AbortRequest(rid="a", reason="stop")) in out
    # Tokens the executor produced before the abort landed are dropped.
    assert d.handle(step(TokenDelta(rid="a", token_ids=[ids[0]])), "sched") == []


def test_eos_is_counted_but_not_shown(tok: Any) -> None:
    d = Detokenizer(tok)
    d.handle(register("b", skip_special_tokens=False), "sched")
    ids = tok.encode("ok", add_special_tokens=False)
    out = d.handle(
        step(
            TokenDelta(rid="b", token_ids=[*ids, EOS_ID], finish="stop", matched_stop_token=EOS_ID)
        ),
        "sched",
    )
    ((_, reply), done) = out
    assert done == ("sched", RequestDone(rid="b"))  # the scheduler forgets its route
    assert isinstance(reply, Delta)
    assert reply.text == "ok" and reply.finish_reason == "stop" and reply.matched_stop == EOS_ID
    assert reply.usage.completion_tokens == len(ids) + 1 and reply.usage.prompt_tokens == 5
    assert "b" not in d.states


def test_an_abort_before_the_executor_ends_the_request_with_no_output(tok: Any) -> None:
    d = Detokenizer(tok)
    d.handle(register("early"), "s")
    ((stream, reply), done) = d.handle(RequestAborted(rid="early"), "s")
    assert stream == "reply:early" and done == ("s", RequestDone(rid="early"))
    assert reply == Delta(
        rid="early",
        text="",
        token_ids=[],
        usage=Usage(prompt_tokens=5, completion_tokens=0),
        finish_reason="abort",
    )
    assert "early" not in d.states and "early" in d.finished
    assert d.handle(RequestAborted(rid="early"), "s") == []  # redelivered: answered once


def test_registration_is_idempotent_and_unknown_rids_ignored(tok: Any) -> None:
    d = Detokenizer(tok)
    d.handle(register("c"), "s")
    d.handle(step(TokenDelta(rid="c", token_ids=tok.encode("ab", add_special_tokens=False))), "s")
    d.handle(register("c"), "s")  # redelivered: must not reset the state
    assert d.states["c"].completion_tokens == 2
    assert d.handle(step(TokenDelta(rid="zzz", token_ids=[1])), "s") == []


def test_random_tokens_in_random_chunks_equal_the_full_decode(tok: Any) -> None:
    """Even invalid UTF-8 from random byte tokens: the pieces add up to decode(all ids)."""
    import random

    for trial in range(200):
        rnd = random.Random(trial)
        ids = [rnd.randrange(0, 264) for _ in range(rnd.randrange(1, 40))]
        d = IncrementalDetokenizer(tok)
        pieces, i = [], 0
        while i < len(ids):
            k = rnd.randrange(1, 4)
            pieces.append(d.push(ids[i : i + k]))
            i += k
        pieces.append(d.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True), ids
        assert all(not p.endswith("\ufffd") for p in pieces[:-1])


def test_tokens_that_decode_to_nothing_do_not_grow_the_window(tok: Any) -> None:
    """A long run of skipped special tokens: the decode window stays short."""
    d = IncrementalDetokenizer(tok)
    for _ in range(500):
        assert d.push([EOS_ID]) == ""
    assert d.read - d.surr <= 1
    assert d.push(tok.encode("ok", add_special_tokens=False)) == "ok"


def test_first_delta_carries_hops_with_the_executors_publication_time(tok: Any) -> None:
    d = Detokenizer(tok)
    d.handle(register("a"), "sched")
    ids = tok.encode("the thing", add_special_tokens=False)
    sent = HopTimes(gateway_received=1.0, executor_inbox=2.0, first_on_host=3.0)
    first = StepOutput(
        executor="e", step=0, deltas=[TokenDelta(rid="a", token_ids=ids[:1], hops=sent)],
        published=4.0,
    )  # fmt: skip
    ((_, reply),) = d.handle(first, "sched")
    assert isinstance(reply, Delta)
    assert reply.hops == msgspec.structs.replace(sent, executor_published=4.0)
    ((_, later),) = d.handle(step(TokenDelta(rid="a", token_ids=ids[1:2])), "sched")
    assert isinstance(later, Delta) and later.hops is None
    # the service stamps the first delta as it publishes it, and leaves the others alone
    (_, stamped), (_, untouched) = d.stamp_published([("g", reply), ("g", later)], 5.0)
    assert isinstance(stamped, Delta) and reply.hops is not None
    assert stamped.hops == msgspec.structs.replace(reply.hops, detok_published=5.0)
    assert untouched is later


def routed(rid: str, resumes: int = 0, avoid: tuple[str, ...] = ()) -> bytes:
    req = TokenizedRequest(
        trace=Trace(rid=rid, reply_to=f"reply:{rid}", deadline=1e12),
        input_ids=[5, 6, 7],
        sampling=SamplingParams(),
        max_new_tokens=32,
        eos_token_ids=[EOS_ID],
        detok_stream="rs:detok:0",
        resumes=resumes,
        avoid=list(avoid),
    )
    return msgspec.msgpack.encode(req)


def test_a_reroute_resumes_the_request_from_the_output_its_client_has(tok: Any) -> None:
    ids = tok.encode("the thin thing in the", add_special_tokens=False)
    d = Detokenizer(tok)
    d.handle(register("r"), "s")
    sent = []
    for t in ids[:4]:
        sent += d.handle(
            StepOutput(executor="old", step=0, deltas=[TokenDelta(rid="r", token_ids=[t])]), "s"
        )
    ((stream, resumed),) = d.handle(Reroute(rid="r", executor="old", request=routed("r")), "s")
    assert stream == "s" and isinstance(resumed, TokenizedRequest)
    assert resumed.resume_ids == ids[:4] and resumed.input_ids == [5, 6, 7]
    assert (resumed.resumes, resumed.avoid) == (1, ["old"])
    # The lost executor may live on: what it still sends is dropped, not shown twice.
    late = StepOutput(executor="old", step=1, deltas=[TokenDelta(rid="r", token_ids=[ids[4]])])
    assert d.handle(late, "s") == []
    rest = TokenDelta(rid="r", token_ids=ids[4:], finish="length")
    out = d.handle(StepOutput(executor="new", step=0, deltas=[rest]), "s")
    text = "".join(m.text for _, m in [*sent, *out] if isinstance(m, Delta))
    assert text == "the thin thing in the"
    final = [m for _, m in out if isinstance(m, Delta)][-1]
    assert final.usage.completion_tokens == len(ids)
    assert ("s", RequestDone(rid="r")) in out
    # Rerouted again after it ended: nothing to resume.
    assert d.handle(Reroute(rid="r", executor="new", request=routed("r")), "s") == []


def test_a_request_that_keeps_losing_its_executor_fails_with_a_retryable_503(tok: Any) -> None:
    d = Detokenizer(tok)
    d.handle(register("p"), "s")
    again = Reroute(rid="p", executor="e3", request=routed("p", resumes=2, avoid=("e1", "e2")))
    (reply_to, failure), done = d.handle(again, "s")
    assert reply_to == "reply:p" and isinstance(failure, Failure)
    assert failure.error.status == 503 and failure.error.retry_after == 1
    assert "3 times" in failure.error.message
    assert done == ("s", RequestDone(rid="p")) and "p" not in d.states


def test_no_stop_trim_keeps_the_stop_token_and_the_stop_string(tok: Any) -> None:
    d = Detokenizer(tok)
    d.handle(register("k", skip_special_tokens=False, no_stop_trim=True), "sched")
    ids = tok.encode("ok", add_special_tokens=False)
    out = d.handle(
        step(
            TokenDelta(rid="k", token_ids=[*ids, EOS_ID], finish="stop", matched_stop_token=EOS_ID)
        ),
        "sched",
    )
    reply = out[0][1]
    assert isinstance(reply, Delta) and reply.text == "ok<|im_end|>"
    d.handle(register("s", stop=["in"], no_stop_trim=True), "sched")
    text = ""
    for i in tok.encode("the thing", add_special_tokens=False):
        for _, m in d.handle(step(TokenDelta(rid="s", token_ids=[i])), "sched"):
            if isinstance(m, Delta):
                text += m.text
    assert text == "the thin"
