"""What happens to the requests of a lost executor.

Each goes back through its detokenizer: the scheduler sends it a `Reroute` carrying the
stored request; the detokenizer, which has every token the lost executor published for it
(they precede the Reroute on its stream), sends the request back to the scheduler with that
output as `resume_ids`, and the next executor prefills prompt + output (mostly from its radix
cache when the prompt was seen before) and carries on from there. The client sees a pause,
then the rest of its text: nothing repeated, nothing lost. A request that had no token yet is
simply sent again. The detokenizer drops anything the lost executor sends later (it may only
have stopped beating), and the request never goes back to it.

An executor that only stopped beating may still be running: its requests are aborted there
too, after its input stream is emptied of what it has not read yet.
"""

from __future__ import annotations

from msgspec import Struct

from services.scheduler.router import LostExecutor
from services.scheduler.routes import RouteRecord
from shared.messages.common import AbortRequest, ErrorInfo
from shared.messages.detok import RequestFailed, Reroute


def reroutes(lost: list[LostExecutor], records: dict[str, RouteRecord]) -> list[tuple[str, Struct]]:
    """The messages that resume every request of the lost executors."""
    out: list[tuple[str, Struct]] = []
    for ex in lost:
        for rid, a in ex.requests.items():
            record = records.get(rid)
            if record is None:  # its route is gone (another version wrote it): retryable
                err = ErrorInfo(
                    status=503,
                    message=f"executor {ex.instance} stopped responding; please retry",
                    type="server_error",
                    retry_after=1,
                )
                out.append((a.detok_stream, RequestFailed(rid=rid, error=err)))
            else:
                out.append(
                    (a.detok_stream, Reroute(rid=rid, executor=ex.instance, request=record.request))
                )
        if ex.maybe_alive and ex.stream:
            out += [(ex.stream, AbortRequest(rid=rid, reason="rerouted")) for rid in ex.requests]
    return out


def streams_to_drop(lost: list[LostExecutor]) -> list[str]:
    """Input streams of lost executors: what they hold unread is resumed elsewhere."""
    return [ex.stream for ex in lost if ex.stream]
