"""Detokenizer service: the one reader of rs:detok:{partition}; text deltas to each gateway."""

from __future__ import annotations

import argparse
import logging
import time

from services.detokenizer.core import Detokenizer
from shared import constants
from shared.bus import StreamReader, publish_many
from shared.config import EnvArgumentParser, add_common_flags, non_negative
from shared.logs import setup_logging
from shared.messages.detok import DetokMessage
from shared.model_files import load_tokenizer, resolve_model
from shared.service import Service, default_instance_id, run_async

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(prog="radixserve detokenizer", description=__doc__)
    add_common_flags(p)
    p.add_flag("--partition", type=int, default=0, check=non_negative, help="partition to serve")
    a = p.parse_args(argv)
    if a.partition >= a.detokenizer_partitions:
        p.error(f"--partition={a.partition} must be < --detokenizer-partitions")
    return a


async def serve(a: argparse.Namespace) -> None:
    source = resolve_model(a.model, a.served_model_name)
    detok = Detokenizer(load_tokenizer(source))
    instance = a.instance_id or f"p{a.partition}-{default_instance_id()}"
    svc = Service("detokenizer", instance, a.redis_url, max_connections=a.redis_max_connections)
    checkpoint = f"{constants.detok_stream(a.partition)}:checkpoint"
    reader: StreamReader[DetokMessage] = StreamReader(
        svc.r, constants.detok_stream(a.partition), DetokMessage
    )

    # Redis restarted empty: the gateways failed every request in flight, so drop their state.
    reader.on_restart.append(detok.forget_all)

    async def work() -> None:
        # Resume where the previous instance of this partition stopped (its checkpoint is
        # written atomically with what it published), so nothing is lost or sent twice.
        saved = await svc.r.get(checkpoint)
        reader.last_id = saved if saved is not None else "0-0"
        last_expire = time.monotonic()
        while not svc.stopping.is_set():
            entries = await reader.read(count=512, block_ms=500)
            out = []
            for e in entries:
                out += detok.handle(e.message, constants.SCHEDULE_STREAM)
            if time.monotonic() - last_expire > 1.0:
                last_expire = time.monotonic()
                detok.expire()
            if entries:
                out = detok.stamp_published(out, time.time())
                await publish_many(svc.r, out, checkpoint=(checkpoint, entries[-1].id))

    log.info("detokenizer partition %d ready", a.partition)
    await svc.run(work)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    setup_logging("detokenizer", a.instance_id or default_instance_id(), a.log_level)
    run_async(lambda: serve(a))


if __name__ == "__main__":
    main()
