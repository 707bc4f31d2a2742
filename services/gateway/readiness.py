"""Can a request be served end to end right now? Computed from the liveness heartbeats.

Ready means a heartbeat younger than MAX_AGE_S from a tokenizer, a grammar service, the
scheduler that holds the leadership, an executor (executors only beat once their model is
loaded) and a detokenizer (the owner of every detokenizer partition, when the partitions are
given). A stage that dies stops beating, so readiness turns false within MAX_AGE_S even before
its key's TTL ends. Heartbeats carry the wall clock of the machine that sent them: the services
of one stack share a clock (one host, or NTP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.messages.heartbeat import Heartbeat

# The services a request passes through, in its order.
PIPELINE = ("tokenizer", "grammar", "scheduler", "executor", "detokenizer")
MAX_AGE_S = 2.0


@dataclass(frozen=True)
class Readiness:
    missing: list[str]  # stages with no fresh heartbeat, in PIPELINE order
    instances: dict[str, int] = field(default_factory=dict)  # fresh instances per stage
    reasons: dict[str, str] = field(default_factory=dict)  # why a stage is missing

    @property
    def ready(self) -> bool:
        return not self.missing

    def message(self) -> str:
        return "; ".join(f"{s}: {self.reasons[s]}" for s in self.missing)


def assess(
    beats: list[Heartbeat],
    leader: str | None,
    now: float,
    max_age_s: float = MAX_AGE_S,
    detok_owners: Sequence[str | None] = (),
) -> Readiness:
    """Readiness from every live heartbeat read, the scheduler leader's instance id, now
    (time.time()) and the owner of each detokenizer partition (when given: a partition whose
    owner died holds its requests until another instance takes it over)."""
    fresh = [b for b in beats if now - b.ts <= max_age_s]
    counts = {s: sum(1 for b in fresh if b.service == s) for s in PIPELINE}
    stale = {b.service for b in beats} - {b.service for b in fresh}
    reasons: dict[str, str] = {}
    for s in PIPELINE:
        if counts[s] == 0:
            reasons[s] = f"no heartbeat within {max_age_s:g}s" if s in stale else "no live instance"
    if "scheduler" not in reasons:
        schedulers = {b.instance for b in fresh if b.service == "scheduler"}
        if leader is None:
            reasons["scheduler"] = "no scheduler leads yet"
        elif leader not in schedulers:
            reasons["scheduler"] = f"the leader {leader} has no fresh heartbeat"
    if "detokenizer" not in reasons and detok_owners:
        live = {b.instance for b in fresh if b.service == "detokenizer"}
        orphaned = [str(p) for p, owner in enumerate(detok_owners) if owner not in live]
        if orphaned:
            reasons["detokenizer"] = f"no live owner of partition(s) {', '.join(orphaned)}"
    missing = [s for s in PIPELINE if s in reasons]
    return Readiness(missing=missing, instances=counts, reasons=reasons)
