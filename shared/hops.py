"""Stamping a request's HopTimes as a service passes it on (see shared/messages/common.py)."""

from __future__ import annotations

import msgspec

from shared.messages.common import HopTimes, Trace


def stamp_hops(hops: HopTimes | None, **at: float) -> HopTimes | None:
    """`hops` with the named stamps set; None stays None (a request sent without HopTimes,
    e.g. by a gateway older than them, is not timed)."""
    return None if hops is None else msgspec.structs.replace(hops, **at)


def stamp(trace: Trace, **at: float) -> Trace:
    """`trace` with the named HopTimes stamps set (unchanged when it carries none)."""
    if trace.hops is None:
        return trace
    return msgspec.structs.replace(trace, hops=stamp_hops(trace.hops, **at))
