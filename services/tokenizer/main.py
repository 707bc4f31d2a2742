"""Tokenizer service: reads rs:tokenize as a consumer-group member, writes to rs:schedule
(or to rs:grammar for a request with a structured-output constraint).

For each request it first registers the request with its detokenizer partition, then hands it
to the scheduler, then acks: Redis keeps each stream's order, so the detokenizer always sees
the registration before any token. A crash between the steps redelivers the entry to another
replica; every downstream handler is idempotent by request id.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from msgspec import Struct

from services.tokenizer.core import PromptError, Tokenization
from shared import constants
from shared.bus import GroupConsumer, publish_many
from shared.config import EnvArgumentParser, add_common_flags, positive
from shared.logs import setup_logging
from shared.messages.common import ErrorInfo
from shared.messages.detok import DetokRegister
from shared.messages.reply import Failure
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import GenerateRequest, TokenizeMessage
from shared.model_files import resolve_model
from shared.service import Service, default_instance_id, run_async

log = logging.getLogger(__name__)


def add_flags(p: EnvArgumentParser) -> None:
    """The tokenizer's own flags (`radixserve serve` takes them too)."""
    p.add_flag("--threads", type=int, default=2, check=positive, help="tokenization threads")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(prog="radixserve tokenizer", description=__doc__)
    add_common_flags(p)
    add_flags(p)
    return p.parse_args(argv)


def handle(tok: Tokenization, req: GenerateRequest, partitions: int) -> list[tuple[str, Struct]]:
    """The messages to publish, in order, for one request."""
    trace = req.trace
    if trace.deadline < time.time():
        err = ErrorInfo(status=504, message="the request's deadline passed", type="timeout")
        return [(trace.reply_to, Failure(rid=trace.rid, error=err))]
    try:
        ids = tok.encode_prompt(req)
        max_new = tok.max_new_tokens(req, len(ids))
        tok.check_sampling(req.sampling, len(ids))
    except PromptError as e:
        return [(trace.reply_to, Failure(rid=trace.rid, error=e.info))]
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
    )
    # A constrained request is compiled (or found in the cache) before it is scheduled.
    target = constants.SCHEDULE_STREAM if req.constraint is None else constants.GRAMMAR_STREAM
    return [(detok, register), (target, tokenized)]


async def serve(a: argparse.Namespace) -> None:
    source = resolve_model(a.model, a.served_model_name)
    tok = Tokenization(source)
    svc = Service("tokenizer", a.instance_id or default_instance_id(), a.redis_url)
    consumer: GroupConsumer[TokenizeMessage] = GroupConsumer(
        svc.r, constants.TOKENIZE_STREAM, constants.TOKENIZE_GROUP, svc.instance, TokenizeMessage
    )
    pool = ThreadPoolExecutor(max_workers=a.threads)
    partitions = a.detokenizer_partitions

    async def work() -> None:
        await consumer.ensure_group()
        loop = asyncio.get_running_loop()
        while not svc.stopping.is_set():
            entries = await consumer.read(count=64, block_ms=500)
            reqs = [(e.id, e.message) for e in entries if isinstance(e.message, GenerateRequest)]
            results = await asyncio.gather(
                *(loop.run_in_executor(pool, handle, tok, m, partitions) for _, m in reqs)
            )
            out = [item for res in results for item in res]
            if out:
                await publish_many(svc.r, out, maxlen=constants.WORK_STREAM_MAXLEN)
            await consumer.ack([e.id for e in entries])

    log.info("tokenizer ready: model %s, context %d", source.name, tok.context_length)
    try:
        await svc.run(work())
    finally:
        pool.shutdown(wait=False)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("tokenizer", args.instance_id or default_instance_id(), args.log_level)
    run_async(lambda: serve(args))


if __name__ == "__main__":
    main()
