"""What the tokenizer publishes for each message of rs:tokenize, synchronously (the service
runs these in its thread pool): a generation is registered with its detokenizer and handed to
the scheduler (or the grammar service); a tokenize or detokenize call is answered at once on
the caller's reply stream.
"""

from __future__ import annotations

import time

from msgspec import Struct

from services.tokenizer.core import PromptError, Tokenization
from shared import constants
from shared.hops import stamp
from shared.messages.common import ErrorInfo, Trace
from shared.messages.detok import DetokRegister
from shared.messages.reply import DetokenizeResult, Failure, TokenizeResult
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import (
    AbortRequest,
    GenerateRequest,
    TokenizeMessage,
    TokenizeRequest,
)

Out = list[tuple[str, Struct]]


def handle(tok: Tokenization, msg: TokenizeMessage, partitions: int) -> Out:
    """The messages to publish, in order, for one entry of rs:tokenize."""
    if isinstance(msg, AbortRequest):
        return []  # aborts go to the scheduler, which refuses the request when it arrives
    if msg.trace.deadline < time.time():
        err = ErrorInfo(status=504, message="the request's deadline passed", type="timeout")
        return [(msg.trace.reply_to, Failure(rid=msg.trace.rid, error=err))]
    try:
        if isinstance(msg, GenerateRequest):
            return generate(tok, msg, partitions)
        if isinstance(msg, TokenizeRequest):
            ids, _ = tok.encode(msg.prompt)
            return _reply(
                msg.trace,
                TokenizeResult(rid=msg.trace.rid, token_ids=ids, max_model_len=tok.context_length),
            )
        text = tok.decode(msg.token_ids, msg.skip_special_tokens, "tokens")
        return _reply(msg.trace, DetokenizeResult(rid=msg.trace.rid, text=text))
    except PromptError as e:
        return _reply(msg.trace, Failure(rid=msg.trace.rid, error=e.info))


def _reply(trace: Trace, message: Struct) -> Out:
    return [(trace.reply_to, message)]


def generate(tok: Tokenization, req: GenerateRequest, partitions: int) -> Out:
    """Register the request with its detokenizer partition, then schedule it: Redis keeps each
    stream's order, so the detokenizer always sees the registration before any token."""
    trace = req.trace
    ids = tok.encode_prompt(req)
    max_new = tok.max_new_tokens(req, len(ids))
    tok.check_sampling(req, len(ids))
    think_end_id = tok.think_end_id(req, ids)
    trace = stamp(trace, tokenized=time.time())
    detok = constants.detok_stream(constants.detok_partition(trace.rid, partitions))
    register = DetokRegister(
        trace=trace,
        prompt_tokens=len(ids),
        sampling=req.sampling,
        echo_text=tok.prompt_text(req, ids) if req.echo else None,
    )
    tokenized = TokenizedRequest(
        trace=trace,
        input_ids=ids,
        sampling=req.sampling,
        max_new_tokens=max_new,
        eos_token_ids=tok.eos_token_ids,
        detok_stream=detok,
        constraint=req.constraint,
        think_end_id=think_end_id,
        embed=req.embed,
        dimensions=req.dimensions,
    )
    # A constrained request is compiled (or found in the cache) before it is scheduled.
    target = constants.SCHEDULE_STREAM if req.constraint is None else constants.GRAMMAR_STREAM
    return [(detok, register), (target, tokenized)]
