"""Which executor gets a request: `--load-balance-method cache_aware|least_load|round_robin`.

A policy sees the request's tokens and the load of each executor it may go to (requests it
holds or will hold: see Router.loads), chooses one, and is told where each request went and
which executors were lost or flushed. Only `cache_aware` keeps state worth the name: a
PrefixTrees of what was routed where.

cache_aware follows SGLang's router (sgl-router's policies/cache_aware.rs, and SMG's
cache-aware policy): the load is imbalanced when both max - min > balance_abs and
max > balance_rel * min; then the least-loaded executor gets the request. Otherwise the
executor whose tree matches the longest prefix gets it if that match covers at least
`cache` of the prompt; else the least-loaded. SGLang sends a low match to the executor with
the smallest tree; we send it to the least-loaded, as SMG's documentation describes, because
our load is exact (the scheduler counts every request it routed until its detokenizer says it
is done) and a new prefix is best computed where the queue is shortest. In both states the
request's tokens join the chosen executor's tree.

The defaults are SGLang router's command-line defaults (sglang_router's RouterArgs:
cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5); its load is also
a count of requests in flight per worker, so the numbers mean the same here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.prefix_tree import PrefixTrees


@dataclass(frozen=True)
class Thresholds:
    cache: float = 0.3  # share of the prompt a tree must match to be followed
    balance_abs: int = 64  # imbalanced when max - min load exceeds this ...
    balance_rel: float = 1.5  # ... and max exceeds this times min

    def __post_init__(self) -> None:
        assert 0.0 <= self.cache <= 1.0 and self.balance_abs >= 0 and self.balance_rel >= 1.0


def least_loaded(loads: Mapping[str, int]) -> str:
    """Ties go to the first name, so a decision is the same whatever the dict's order."""
    return min(loads, key=lambda name: (loads[name], name))


def imbalanced(loads: Mapping[str, int], t: Thresholds) -> bool:
    high, low = max(loads.values()), min(loads.values())
    return high - low > t.balance_abs and high > t.balance_rel * low


def cache_aware_choice(
    prompt_len: int, loads: Mapping[str, int], matched: Mapping[str, int], t: Thresholds
) -> str:
    """The cache-aware decision, pure: `matched` is what each executor's tree holds of the
    prompt (absent: nothing)."""
    if imbalanced(loads, t):
        return least_loaded(loads)
    best = min(loads, key=lambda name: (-matched.get(name, 0), loads[name], name))
    if prompt_len > 0 and matched.get(best, 0) / prompt_len >= t.cache:
        return best
    return least_loaded(loads)


class Policy:
    """Least-loaded, and the interface: the other policies override what they need."""

    def choose(self, tokens: Sequence[int], loads: Mapping[str, int]) -> str:
        """One of `loads`' executors (never empty) for a request of these tokens."""
        return least_loaded(loads)

    def routed(self, executor: str, tokens: Sequence[int], capacity: int) -> None:
        """The request went to `executor`, which caches at most `capacity` tokens."""

    def lost(self, executor: str) -> None:
        """`executor` stopped serving: nothing of it is left to route by."""

    def flushed(self) -> None:
        """Every executor was asked to drop its cached prefixes."""


@dataclass
class RoundRobin(Policy):
    turn: int = 0  # requests routed so far

    def choose(self, tokens: Sequence[int], loads: Mapping[str, int]) -> str:
        names = sorted(loads)
        return names[self.turn % len(names)]

    def routed(self, executor: str, tokens: Sequence[int], capacity: int) -> None:
        self.turn += 1


@dataclass
class CacheAware(Policy):
    thresholds: Thresholds = field(default_factory=Thresholds)
    trees: PrefixTrees = field(default_factory=PrefixTrees)
    # Tokens one executor's tree may hold; 0: the executor's KV pool (its heartbeat's
    # total_kv_tokens), so the tree never claims more than the executor could cache.
    max_tree_tokens: int = 0

    def choose(self, tokens: Sequence[int], loads: Mapping[str, int]) -> str:
        matched = self.trees.match(tokens) if not imbalanced(loads, self.thresholds) else {}
        return cache_aware_choice(len(tokens), loads, matched, self.thresholds)

    def routed(self, executor: str, tokens: Sequence[int], capacity: int) -> None:
        limit = min(self.max_tree_tokens, capacity) if self.max_tree_tokens else capacity
        self.trees.insert(executor, tokens, limit)

    def lost(self, executor: str) -> None:
        self.trees.drop(executor)

    def flushed(self) -> None:
        self.trees.clear()


METHODS: dict[str, Callable[[Thresholds, int], Policy]] = {
    "cache_aware": lambda t, tree_tokens: CacheAware(t, max_tree_tokens=tree_tokens),
    "least_load": lambda t, tree_tokens: Policy(),
    "round_robin": lambda t, tree_tokens: RoundRobin(),
}


def make_policy(method: str, thresholds: Thresholds, max_tree_tokens: int = 0) -> Policy:
    try:
        return METHODS[method](thresholds, max_tree_tokens)
    except KeyError:
        raise ValueError(f"unknown load balance method {method!r}") from None
