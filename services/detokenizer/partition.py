"""One owner's tenure of one partition, without I/O: the replay after a takeover, then normal
work, and what each batch of entries commits (replies, checkpoint, recovery record).

The replay covers the entries from the low-water mark up to the checkpoint: their replies were
published by the previous owner (atomically with that checkpoint), so they are rebuilt and
discarded. Entries after the checkpoint were never answered and are answered now. Duplicates
are impossible by construction, so the gateway needs no sequence numbers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from msgspec import Struct

from services.detokenizer import recovery
from services.detokenizer.core import Detokenizer
from shared.bus import Entry
from shared.messages.detok import DetokMessage


class Commit(NamedTuple):
    out: list[tuple[str, Struct]]
    checkpoint: str  # "": unchanged (nothing to commit unless `out`)
    recovery: bytes  # b"": unchanged
    # With a recovery record: its low-water mark. Once committed, the stream's entries before
    # it are needed by nobody (a successor replays from it), so they may be trimmed.
    low_water: str = ""


class Resume(NamedTuple):
    """Where reading starts (XREAD after `read_after`), up to where output is discarded, and
    the checkpoint found."""

    read_after: str
    replay_until: tuple[int, int] | None
    checkpoint: str = "0-0"


def resume_point(checkpoint: bytes | None, rec: recovery.Recovery | None) -> Resume:
    if checkpoint is None:
        return Resume("0-0", None)  # a new partition (or Redis started over): read it all
    done = recovery.id_str(checkpoint)
    if rec is None:
        return Resume(done, None, done)  # nothing was open (or an old version wrote it)
    return Resume(recovery.id_before(rec.low_water), recovery.parse_id(done), done)


class Partition:
    def __init__(
        self,
        tokenizer: Any,
        schedule_stream: str,
        resume: Resume,
        rec: recovery.Recovery | None = None,
    ) -> None:
        self.detok = Detokenizer(tokenizer)
        self.schedule_stream = schedule_stream
        self.replay_until = resume.replay_until
        # Every entry up to here is answered. It never moves back during a replay: a successor
        # taking over from a checkpoint inside the replayed range would answer again.
        self.checkpoint = resume.checkpoint
        self.detok.replaying = self.replay_until is not None
        if self.replaying and rec is not None:
            self.detok.orphans = dict(rec.open)
        self.replayed = 0
        self._last_recovery = -1e9  # write one with the first commit
        self._last_expire = time.monotonic()

    @property
    def replaying(self) -> bool:
        return self.replay_until is not None

    def _end_replay(self) -> list[tuple[str, Struct]]:
        self.replay_until = None
        self.detok.replaying = False
        return self.detok.fail_orphans(self.schedule_stream)

    def feed(self, entries: Sequence[Entry[DetokMessage]], now: float | None = None) -> Commit:
        """Handle a batch read from the stream (empty: the stream had nothing more)."""
        now = time.monotonic() if now is None else now
        out: list[tuple[str, Struct]] = []
        if self.replaying and not entries:  # the checkpointed entry is gone (trimmed)
            out += self._end_replay()
        for e in entries:
            replies = self.detok.handle(e.message, self.schedule_stream, e.id)
            if self.replay_until is not None:
                if recovery.parse_id(e.id) <= self.replay_until:
                    self.replayed += 1
                    continue  # published by the previous owner
                out += self._end_replay()
            out += replies
        if now - self._last_expire > 1.0:
            self._last_expire = now
            self.detok.expire()
        out = self.detok.stamp_published(out, time.time())
        moved = bool(entries) and not self.replaying
        if moved:
            self.checkpoint = recovery.id_str(entries[-1].id)
        if not moved and not out:
            return Commit([], "", b"")
        return Commit(out, self.checkpoint, *self._recovery(now))

    def _recovery(self, now: float) -> tuple[bytes, str]:
        """A new recovery record and its low-water mark, or (b"", "") if not due."""
        # Not while replaying: the requests the replay has not reached are open too.
        if self.replaying or now - self._last_recovery < recovery.RECOVERY_EVERY_S:
            return b"", ""
        self._last_recovery = now
        low = self.detok.low_water()
        # Nothing open: a successor replays nothing before the checkpoint.
        low_id = f"{low[0]}-{low[1]}" if low is not None else self.checkpoint
        return recovery.encode(recovery.Recovery(low_id, self.detok.open_replies())), low_id
