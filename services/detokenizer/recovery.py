"""What a detokenizer partition keeps in Redis so that another instance (or its restarted
self) rebuilds its requests' state, and the stream ids that replay works with.

Two keys per partition, both written in the same atomic, lease-fenced commit as the replies
(see lease.py):

- `{stream}:checkpoint`: the id of the last entry whose replies are published. Everything up to
  it was sent exactly once, everything after it not at all.
- `{stream}:recovery`: a `Recovery` written every RECOVERY_EVERY_S: the low-water mark (the
  first entry of the oldest request still open: every request that began before it has
  finished) and the open requests' reply streams.

A new owner replays the stream from the low-water mark up to the checkpoint with its output
discarded (it was already published: detokenizing is a pure function of the entries, so the
replay rebuilds exactly the state the old owner had), then carries on normally. A stale
recovery record is harmless: the low-water mark only moves forward, so an older one replays
more, never less.
"""

from __future__ import annotations

import msgspec

# How often the recovery record is rewritten (the checkpoint goes with every commit).
RECOVERY_EVERY_S = 0.5


class Recovery(msgspec.Struct, array_like=True, frozen=True):
    low_water: str  # replay from this entry (inclusive)
    open: dict[str, str]  # rid -> reply stream, of every request open when this was written


def checkpoint_key(stream: str) -> str:
    return f"{stream}:checkpoint"


def recovery_key(stream: str) -> str:
    return f"{stream}:recovery"


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def id_str(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def id_before(entry_id: bytes | str) -> str:
    """The largest id below `entry_id`: XREAD after it starts at `entry_id` itself."""
    ms, seq = parse_id(entry_id)
    if seq > 0:
        return f"{ms}-{seq - 1}"
    if ms > 0:
        return f"{ms - 1}-{2**64 - 1}"
    return "0-0"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Recovery)


def encode(rec: Recovery) -> bytes:
    return _encoder.encode(rec)


def decode(raw: bytes | None) -> Recovery | None:
    if raw is None:
        return None
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError:
        return None  # written by another version: replay from the checkpoint only
