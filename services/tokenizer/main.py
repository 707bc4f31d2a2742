"""Tokenizer service: reads rs:tokenize as a consumer-group member, writes to rs:schedule
(or to rs:grammar for a request with a structured-output constraint), and answers tokenize /
detokenize calls on the caller's reply stream (handlers.py says what goes where).

It acks an entry only after publishing what it led to. A crash in between redelivers the entry
to another replica; every downstream handler is idempotent by request id.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from services.tokenizer.core import Tokenization
from services.tokenizer.metrics import TokenizerMetrics
from shared import constants
from shared.bus import GroupConsumer
from shared.config import EnvArgumentParser, add_common_flags, positive
from shared.logs import setup_logging
from shared.messages.tokenize import TokenizeMessage
from shared.model_files import resolve_model
from shared.service import default_instance_id, run_async, service_from_flags

log = logging.getLogger(__name__)


def add_flags(p: EnvArgumentParser) -> None:
    """The tokenizer's own flags (`radixserve serve` takes them too)."""
    p.add_flag("--threads", type=int, default=2, check=positive, help="tokenization threads")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(prog="radixserve tokenizer", description=__doc__)
    add_common_flags(p)
    add_flags(p)
    return p.parse_args(argv)


async def serve(a: argparse.Namespace) -> None:
    source = resolve_model(a.model, a.served_model_name)
    tok = Tokenization(source)
    svc = service_from_flags("tokenizer", a, source.name, model=tok.model_info())
    metrics = TokenizerMetrics(svc.metrics, svc.tracing)
    consumer: GroupConsumer[TokenizeMessage] = GroupConsumer(
        svc.r,
        constants.TOKENIZE_STREAM,
        constants.TOKENIZE_GROUP,
        svc.instance,
        TokenizeMessage,
        service="tokenizer",  # a dead replica's entries are taken over at once
    )
    svc.watch("tokenize", consumer)
    pool = ThreadPoolExecutor(max_workers=a.threads)
    partitions = a.detokenizer_partitions

    async def work() -> None:
        await consumer.ensure_group()
        loop = asyncio.get_running_loop()
        while not svc.stopping.is_set():
            entries = await consumer.read(count=64, block_ms=500)
            results = await asyncio.gather(
                *(
                    loop.run_in_executor(pool, metrics.handle, tok, e.message, partitions)
                    for e in entries
                )
            )
            out = [item for res in results for item in res]
            ids = [e.id for e in entries]
            await consumer.commit(out, ids, maxlen=constants.WORK_STREAM_MAXLEN)

    log.info("tokenizer ready: model %s, context %d", source.name, tok.context_length)
    try:
        await svc.run(work)
    finally:
        pool.shutdown(wait=False)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("tokenizer", args.instance_id or default_instance_id(), args.log_level)
    run_async(lambda: serve(args))


if __name__ == "__main__":
    main()
