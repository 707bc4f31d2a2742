"""Every wire message survives a msgpack round trip, through its stream's union type."""

from __future__ import annotations

import msgspec
import pytest

from shared.bus import Codec
from shared.messages.common import (
    ChoiceConstraint,
    EbnfConstraint,
    ErrorInfo,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    Trace,
)
from shared.messages.detok import (
    DetokMessage,
    DetokRegister,
    RequestAborted,
    RequestFailed,
    StepOutput,
    TokenDelta,
)
from shared.messages.grammar import (
    CompiledGrammarEntry,
    GrammarCacheEntry,
    GrammarErrorEntry,
    GrammarMessage,
)
from shared.messages.heartbeat import ExecutorLoad, Heartbeat, ModelInfo
from shared.messages.reply import (
    Delta,
    DetokenizeResult,
    Failure,
    ReplyMessage,
    TokenizeResult,
    Usage,
)
from shared.messages.schedule import ExecutorMessage, FlushCache, TokenizedRequest
from shared.messages.tokenize import (
    AbortRequest,
    ChatMessage,
    ChatPrompt,
    DetokenizeRequest,
    GenerateRequest,
    TextPrompt,
    TokenizeMessage,
    TokenizeRequest,
    TokenPrompt,
)

TRACE = Trace(rid="r1", reply_to="rs:reply:g1", deadline=1e10, traceparent="00-ab-cd-01")
SP = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=20, stop=["\n\n"])

CASES = [
    (TokenizeMessage, GenerateRequest(trace=TRACE, prompt=TextPrompt(text="hi"), sampling=SP)),
    (
        TokenizeMessage,
        GenerateRequest(
            trace=TRACE, prompt=TokenPrompt(input_ids=[1, 2]), sampling=SP, stream=True
        ),
    ),
    (
        TokenizeMessage,
        GenerateRequest(
            trace=TRACE,
            prompt=ChatPrompt(messages=[ChatMessage(role="user", content="é 世界")]),
            sampling=SamplingParams(),
        ),
    ),
    (TokenizeMessage, AbortRequest(rid="r1", reason="client gone")),
    (
        ExecutorMessage,
        TokenizedRequest(
            trace=TRACE,
            input_ids=[5, 6, 7],
            sampling=SP,
            max_new_tokens=7,
            eos_token_ids=[2],
            detok_stream="rs:detok:0",
        ),
    ),
    (ExecutorMessage, FlushCache()),
    (
        TokenizeMessage,
        GenerateRequest(
            trace=TRACE,
            prompt=TextPrompt(text="hi"),
            sampling=SP,
            constraint=JsonSchemaConstraint(schema='{"type": "object"}', param="response_format"),
        ),
    ),
    (
        GrammarMessage,
        TokenizedRequest(
            trace=TRACE,
            input_ids=[5],
            sampling=SP,
            max_new_tokens=7,
            eos_token_ids=[2],
            detok_stream="rs:detok:0",
            constraint=ChoiceConstraint(choices=["a", "é"]),
        ),
    ),
    (
        ExecutorMessage,
        TokenizedRequest(
            trace=TRACE,
            input_ids=[5],
            sampling=SP,
            max_new_tokens=7,
            eos_token_ids=[2],
            detok_stream="rs:detok:0",
            constraint=RegexConstraint(pattern="a+"),
            grammar_key="k1",
        ),
    ),
    (
        ExecutorMessage,
        TokenizedRequest(
            trace=TRACE,
            input_ids=[5],
            sampling=SP,
            max_new_tokens=7,
            eos_token_ids=[2],
            detok_stream="rs:detok:0",
            constraint=EbnfConstraint(grammar='root ::= "x"', param="sampling_params.ebnf"),
            grammar_key="k2",
        ),
    ),
    (GrammarCacheEntry, CompiledGrammarEntry(data=b"\x00zlib", compile_ms=1.5, kind="regex")),
    (GrammarCacheEntry, GrammarErrorEntry(message="invalid regex: ...", kind="regex")),
    (DetokMessage, DetokRegister(trace=TRACE, prompt_tokens=3, sampling=SP)),
    (
        DetokMessage,
        StepOutput(
            executor="e0",
            step=4,
            deltas=[
                TokenDelta(rid="r1", token_ids=[9]),
                TokenDelta(
                    rid="r2",
                    token_ids=[10, 11],
                    finish="stop",
                    cached_tokens=3,
                    matched_stop_token=11,
                ),
            ],
        ),
    ),
    (DetokMessage, RequestFailed(rid="r1", error=ErrorInfo(status=503, message="full"))),
    (DetokMessage, RequestAborted(rid="r1", reason="abort_request")),
    (
        TokenizeMessage,
        TokenizeRequest(
            trace=TRACE,
            prompt=ChatPrompt(
                messages=[ChatMessage(role="user", content="hi")], add_generation_prompt=False
            ),
        ),
    ),
    (TokenizeMessage, TokenizeRequest(trace=TRACE, prompt=TextPrompt(text="hé"))),
    (TokenizeMessage, DetokenizeRequest(trace=TRACE, token_ids=[1, 2], skip_special_tokens=True)),
    (ReplyMessage, TokenizeResult(rid="r1", token_ids=[1, 2], max_model_len=8)),
    (ReplyMessage, DetokenizeResult(rid="r1", text="é 世界")),
    (
        ReplyMessage,
        Delta(
            rid="r1",
            text="a",
            token_ids=[1],
            usage=Usage(prompt_tokens=3, completion_tokens=1),
            finish_reason="stop",
            matched_stop="\n",
        ),
    ),
    (ReplyMessage, Failure(rid="r1", error=ErrorInfo(status=400, message="x", param="max_tokens"))),
    (
        Heartbeat,
        Heartbeat(
            service="executor",
            instance="e0",
            pid=1,
            started=1.0,
            ts=2.0,
            executor=ExecutorLoad(
                stream="s",
                model="m",
                context_length=8,
                waiting=1,
                running=2,
                free_kv_tokens=3,
                total_kv_tokens=4,
            ),
        ),
    ),
    (
        Heartbeat,
        Heartbeat(
            service="tokenizer",
            instance="t0",
            pid=1,
            started=1.0,
            ts=2.0,
            model=ModelInfo(
                path="/m",
                name="m",
                architecture="llama",
                context_length=8,
                vocab_size=10,
                eos_token_ids=[2],
                has_chat_template=False,
            ),
        ),
    ),
]


@pytest.mark.parametrize(("union", "message"), CASES, ids=lambda x: type(x).__name__)
def test_round_trip(union: object, message: msgspec.Struct) -> None:
    codec: Codec[object] = Codec(union)
    assert codec.decode(codec.encode(message)) == message


def test_hot_step_message_is_compact() -> None:
    """StepOutput is array-like: no field names on the wire for the per-step hot message."""
    step = StepOutput(executor="e0", step=1, deltas=[TokenDelta(rid="abc", token_ids=[42])])
    wire = msgspec.msgpack.encode(step)
    assert b"token_ids" not in wire and b"executor" not in wire
    # 23 bytes before HopTimes; each delta's unset `hops` and `embedding` and the step's unset
    # `published` add one nil byte each (msgspec writes every field of an array-like struct)
    assert len(wire) <= 26


def test_requests_without_a_constraint_still_decode() -> None:
    """An older producer's TokenizedRequest (no constraint fields) decodes with defaults."""
    old = {
        "type": "tokenized",
        "trace": msgspec.to_builtins(TRACE),
        "input_ids": [1],
        "sampling": {},
        "max_new_tokens": 1,
        "eos_token_ids": [2],
        "detok_stream": "d",
    }
    msg = Codec[object](ExecutorMessage).decode(msgspec.msgpack.encode(old))
    assert isinstance(msg, TokenizedRequest)
    assert (msg.constraint, msg.grammar_key) == (None, "")


def test_an_older_heartbeat_decodes_without_a_model() -> None:
    old = {"service": "tokenizer", "instance": "t0", "pid": 1, "started": 1.0, "ts": 2.0}
    beat = msgspec.msgpack.Decoder(Heartbeat).decode(msgspec.msgpack.encode(old))
    assert beat.model is None and beat.executor is None


def test_wrong_type_is_rejected() -> None:
    codec: Codec[object] = Codec(TokenizeMessage)
    bad = msgspec.msgpack.encode({"type": "abort", "rid": 5})
    with pytest.raises(msgspec.ValidationError, match="rid"):
        codec.decode(bad)
