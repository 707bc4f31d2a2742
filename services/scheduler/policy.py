"""Which executor gets a request: `--load-balance-method cache_aware|least_load|round_robin`.

A policy sees the request's tokens and the load of each executor it may go to (requests it
holds or will hold: see Router.loads), chooses one, and is told where each request went and
which executors were lost or flushed. Only `cache_aware` keeps state worth the name: a
PrefixTrees of what was routed where.

cache_aware follows SGLang's router (sgl-router's policies/cache_aware.rs, and SMG's
src/policies/cache_aware.rs): the load is imbalanced when both max - min > balance_abs and
max > balance_rel * min; then the least-loaded executor gets the request. Otherwise the
executor whose tree matches the longest prefix gets it if that match covers at least
`cache` of the prompt; else the executor with the smallest tree (ties: the less loaded). In
both states the request's tokens join the chosen executor's tree.

A new prefix goes to the smallest tree, as in both codes (SMG's documentation says the
least-loaded; its code does not), because the momentary load misleads in a burst: when a
group's first request arrives, the groups already placed have not sent their followers yet.
Routing the shared-prefix workload in the order it is sent at once (8 groups x 8 prompts,
and 64 x 16), least-loaded put 5 of 8 groups on one executor (40 requests against 24) and 34
of 64 (544 against 480); the smallest tree put 4 and 4, 32 and 32. An executor whose load
runs away is still caught by the imbalance test.

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
    prompt_len: int,
    loads: Mapping[str, int],
    matched: Mapping[str, int],
    tree_tokens: Mapping[str, int],
    t: Thresholds,
) -> str:
    """The cache-aware decision, pure: `matched` is what each executor's tree holds of the
    prompt, `tree_tokens` what it holds in all (absent: nothing)."""
    if imbalanced(loads, t):
        return least_loaded(loads)
    best = min(loads, key=lambda name: (-matched.get(name, 0), loads[name], name))
    if prompt_len > 0 and matched.get(best, 0) / prompt_len >= t.cache:
        return best
    return min(loads, key=lambda name: (tree_tokens.get(name, 0), loads[name], name))


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
        if imbalanced(loads, self.thresholds):
            return least_loaded(loads)
        sizes = {name: self.trees.tokens(name) for name in loads}
        return cache_aware_choice(
            len(tokens), loads, self.trees.match(tokens), sizes, self.thresholds
        )

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
