"""Routing between several executors (data parallelism), without Redis: the samples and turns
of one request follow its prefix, the load counts what is in flight, and a lost executor's
prefixes and requests go elsewhere."""

from __future__ import annotations

import msgspec

from services.scheduler import failover, routes
from services.scheduler.policy import CacheAware, Policy, RoundRobin, Thresholds
from services.scheduler.router import Router
from shared.messages.detok import Reroute
from shared.messages.heartbeat import Heartbeat
from shared.messages.schedule import FlushCache, TokenizedRequest
from tests.scheduler.factories import beat, make_request

PROMPT = list(range(100, 140))  # 40 tokens: two whole blocks and a partial one
OTHER = list(range(500, 540))


def big_beat(name: str, ts: float = 1.0, running: int = 0, total: int = 4096) -> Heartbeat:
    return beat(name, running=running, ts=ts, context_length=4096, total_kv_tokens=total)


def dp_router(policy: Policy | None = None) -> Router:
    r = Router(max_queued=1000, policy=policy or CacheAware(Thresholds()))
    r.update_executors([big_beat("e1"), big_beat("e2")], now=0.0)
    return r


def target(r: Router, rid: str, ids: list[int]) -> str:
    ((stream, _),) = r.route(make_request(rid, ids=ids))
    return stream.removeprefix("rs:exec:")


def test_the_samples_of_one_request_land_on_one_executor() -> None:
    """`n` samples arrive as requests rid, rid-1, ... of one prompt: the first one's prefix
    is in its executor's tree when the next is routed."""
    r = dp_router()
    assert [target(r, f"a-{i}" if i else "a", PROMPT) for i in range(4)] == ["e1"] * 4
    # Another prompt goes where the load is lower; its samples follow it there.
    assert [target(r, f"b-{i}" if i else "b", OTHER) for i in range(4)] == ["e2"] * 4
    # Least-loaded routing spreads them, which is what cache_aware avoids.
    spread = dp_router(Policy())
    assert [target(spread, f"a-{i}", PROMPT) for i in range(4)] == ["e1", "e2", "e1", "e2"]


def test_the_turns_of_a_conversation_follow_its_first_turn() -> None:
    r = dp_router()
    assert target(r, "other", OTHER) == "e1"
    assert target(r, "turn-1", PROMPT) == "e2"
    answer, follow_up = list(range(900, 912)), list(range(950, 960))
    # Turn 2 carries turn 1's prompt (its 32 tokens of whole blocks match) and more.
    assert target(r, "turn-2", PROMPT + answer + follow_up) == "e2"


def test_a_burst_of_groups_is_split_evenly_by_their_prefixes() -> None:
    """A new prefix goes to the executor holding the fewest prefix tokens, not the one with
    the fewest requests right now: when C and D arrive, e1 holds 3 requests of A against
    e2's one of B, but A's followers came early and B's come later."""
    r = dp_router()
    system = {g: [100 * (i + 1) + t for t in range(32)] for i, g in enumerate("ABCD")}
    order = "ABAACDBCDBCD"
    placed: dict[str, set[str]] = {}
    per_executor = {"e1": 0, "e2": 0}
    for i, group in enumerate(order):
        executor = target(r, f"r{i}", system[group] + [7, i, 7, i, 7, i, 7, i])
        placed.setdefault(group, set()).add(executor)
        per_executor[executor] += 1
    assert placed == {"A": {"e1"}, "B": {"e2"}, "C": {"e2"}, "D": {"e1"}}
    assert per_executor == {"e1": 6, "e2": 6}


def test_an_imbalanced_load_overrides_the_cache() -> None:
    r = dp_router(CacheAware(Thresholds(cache=0.3, balance_abs=2, balance_rel=1.5)))
    chosen = [target(r, f"a-{i}", PROMPT) for i in range(5)]
    # e1 takes the prompt until it holds 3 more than e2 (3 > 2, 3 > 1.5 x 0); then e2, which
    # now holds the prompt too and is the less loaded of the two.
    assert chosen == ["e1", "e1", "e1", "e2", "e2"]


def test_load_counts_what_is_in_flight_across_heartbeats() -> None:
    """A heartbeat sent before its executor read what was routed to it reports it idle: the
    requests in flight still count, so a burst keeps alternating."""
    r = dp_router(Policy())
    assert [target(r, f"r{i}", PROMPT) for i in range(4)] == ["e1", "e2", "e1", "e2"]
    r.update_executors([big_beat("e1", ts=2.0), big_beat("e2", ts=1.0)], now=0.1)
    assert r.loads(list(r.executors.values())) == {"e1": 2, "e2": 2}
    assert [target(r, f"s{i}", PROMPT) for i in range(4)] == ["e1", "e2", "e1", "e2"]
    # Done requests stop counting; a heartbeat that reports more than the table counts.
    for rid in ("r0", "r2", "s0", "s2"):
        r.done(rid)
    r.update_executors([big_beat("e1", ts=3.0), big_beat("e2", ts=3.0, running=6)], now=0.2)
    assert r.loads(list(r.executors.values())) == {"e1": 0, "e2": 6}


def test_round_robin_takes_turns() -> None:
    r = dp_router(RoundRobin())
    assert [target(r, f"a-{i}", PROMPT) for i in range(4)] == ["e1", "e2", "e1", "e2"]


def test_a_lost_executor_leaves_the_table_its_tree_goes_and_its_requests_go_elsewhere() -> None:
    policy = CacheAware(Thresholds())
    r = dp_router(policy)
    assert target(r, "started", PROMPT) == "e1"
    assert target(r, "queued", PROMPT) == "e1"
    assert target(r, "elsewhere", OTHER) == "e2"
    saves, _ = r.take_changes()
    r.committed()
    records = {rid: rec for rid, raw in saves.items() if (rec := routes.decode(raw)) is not None}
    # e1's liveness key is gone (the supervisor saw it exit).
    (lost,) = r.update_executors([big_beat("e2", ts=2.0)], now=1.0)
    assert (lost.instance, sorted(lost.requests)) == ("e1", ["queued", "started"])
    assert list(r.executors) == ["e2"] and policy.trees.executors() == ["e2"]
    assert policy.trees.match(PROMPT) == {}
    # Each goes back through its detokenizer, which returns it avoiding e1: to e2, the
    # one that had not started with no output to carry.
    reroutes = failover.reroutes([lost], records)
    assert sorted(m.rid for _, m in reroutes if isinstance(m, Reroute)) == ["queued", "started"]
    queued = msgspec.structs.replace(make_request("queued", ids=PROMPT), resumes=1, avoid=["e1"])
    started = msgspec.structs.replace(
        make_request("started", ids=PROMPT), resume_ids=[7, 8], resumes=1, avoid=["e1"]
    )
    assert [s for s, _ in r.route(queued) + r.route(started)] == ["rs:exec:e2"] * 2
    # New requests of that prompt go to e2 too, and follow it there when e1's replacement
    # comes up.
    r.update_executors([big_beat("e2", ts=3.0), big_beat("e1b", ts=3.0)], now=2.0)
    assert target(r, "later", PROMPT) == "e2"


def test_a_new_leader_learns_the_prefixes_of_the_requests_in_flight() -> None:
    r = dp_router()
    assert target(r, "other", OTHER) == "e1"
    assert target(r, "a", PROMPT) == "e2"
    saves, _ = r.take_changes()
    fresh = dp_router()
    for rid, raw in saves.items():
        record = routes.decode(raw)
        assert record is not None
        fresh.restore(rid, record)
    assert fresh.loads(list(fresh.executors.values())) == {"e1": 1, "e2": 1}
    # The samples of "a" follow it to e2, as they would have with the old leader.
    assert target(fresh, "a-1", PROMPT) == "e2"
    assert target(fresh, "other-1", OTHER) == "e1"


def test_a_cache_flush_forgets_every_prefix() -> None:
    policy = CacheAware(Thresholds())
    r = dp_router(policy)
    assert target(r, "a", PROMPT) == "e1"
    out = r.flush_cache(FlushCache(rid="f"))
    assert [s for s, _ in out] == ["rs:exec:e1", "rs:exec:e2"]
    assert policy.trees.nodes() == 0
    assert target(r, "a-1", PROMPT) == "e2"  # least-loaded again


def test_an_executors_tree_holds_no_more_than_its_kv_pool() -> None:
    policy = CacheAware(Thresholds())
    r = Router(max_queued=100, policy=policy)
    r.update_executors([big_beat("e1", total=48)], now=0.0)
    for i in range(3):
        target(r, f"r{i}", [i] * 40)
    # 40 tokens each: the latest prompt is kept, the older ones are shed to fit 48
    assert policy.trees.tokens("e1") == 40
    assert policy.trees.match([2] * 40) == {"e1": 40} and policy.trees.match([1] * 40) == {}


def test_routed_requests_are_stored_unchanged_by_the_policy() -> None:
    r = dp_router()
    ((_, sent),) = r.route(make_request("a", ids=PROMPT))
    assert isinstance(sent, TokenizedRequest) and sent.input_ids == PROMPT
