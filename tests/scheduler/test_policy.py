"""The routing policies as pure decisions: crafted trees and loads, the exact executor chosen."""

from __future__ import annotations

import pytest

from services.scheduler.policy import (
    CacheAware,
    Policy,
    RoundRobin,
    Thresholds,
    cache_aware_choice,
    imbalanced,
    make_policy,
)
from services.scheduler.prefix_tree import PrefixTrees

T = Thresholds(cache=0.5, balance_abs=4, balance_rel=1.5)
SYSTEM = list(range(1000, 1064))  # 64 tokens: four whole blocks


def trees_with(routes: dict[str, list[list[int]]]) -> PrefixTrees:
    trees = PrefixTrees()
    for executor, prompts in routes.items():
        for p in prompts:
            trees.insert(executor, p, 10**6)
    return trees


@pytest.mark.parametrize(
    ("loads", "want"),
    [
        ({"a": 10, "b": 5}, True),  # 5 > 4 and 10 > 7.5
        ({"a": 10, "b": 7}, False),  # 3 is within the absolute threshold
        ({"a": 20, "b": 15}, False),  # 5 > 4, but 20 < 22.5: within the relative one
        ({"a": 5, "b": 0, "c": 3}, True),  # max and min over all of them
        ({"a": 0}, False),
    ],
)
def test_imbalance_needs_both_thresholds_exceeded(loads: dict[str, int], want: bool) -> None:
    assert imbalanced(loads, T) is want


def test_balanced_a_match_at_the_threshold_wins_over_load() -> None:
    sizes = {"a": 300, "b": 200}
    # b holds half the prompt: the threshold is met (>=), and b is followed though busier.
    assert cache_aware_choice(100, {"a": 0, "b": 3}, {"b": 50}, sizes, T) == "b"
    # Below it: the executor holding the fewest prefix tokens, b, though the busier.
    assert cache_aware_choice(100, {"a": 0, "b": 3}, {"b": 49}, sizes, T) == "b"
    assert cache_aware_choice(100, {"a": 0, "b": 3}, {"b": 49}, {"a": 100}, T) == "b"
    assert cache_aware_choice(100, {"a": 0, "b": 3}, {"b": 49}, {"b": 100}, T) == "a"
    # Trees alike (or none): the less loaded, then the first name; so for an empty prompt.
    assert cache_aware_choice(100, {"a": 2, "b": 1}, {}, {}, T) == "b"
    assert cache_aware_choice(100, {"b": 1, "a": 1}, {}, {"a": 9, "b": 9}, T) == "a"
    assert cache_aware_choice(0, {"a": 2, "b": 1}, {}, {}, T) == "b"


def test_imbalanced_the_least_loaded_wins_over_a_full_match() -> None:
    sizes = {"a": 100, "b": 500}
    assert cache_aware_choice(100, {"a": 10, "b": 5}, {"a": 100}, sizes, T) == "b"
    assert cache_aware_choice(100, {"a": 10, "b": 7}, {"a": 100}, sizes, T) == "a"
    # and over the smallest tree
    assert cache_aware_choice(100, {"a": 10, "b": 5}, {}, sizes, T) == "b"


def test_equal_matches_go_to_the_less_loaded_then_the_first_name() -> None:
    loads = {"a": 3, "b": 2, "c": 0}
    assert cache_aware_choice(100, loads, {"a": 80, "b": 80}, {}, T) == "b"
    loads = {"a": 2, "b": 2, "c": 0}
    assert cache_aware_choice(100, loads, {"a": 80, "b": 80}, {}, T) == "a"
    # The longer match wins whatever the load, while balanced.
    assert cache_aware_choice(100, {"a": 3, "b": 2}, {"a": 90, "b": 80}, {}, T) == "a"


def test_cache_aware_follows_the_tree_holding_the_longest_prefix() -> None:
    question = list(range(2000, 2016))
    trees = trees_with(
        {"e1": [SYSTEM + [1] * 16], "e2": [SYSTEM[:32] + [7] * 32], "e3": [[5] * 64]}
    )
    policy = CacheAware(T, trees)
    loads = {"e1": 3, "e2": 1, "e3": 0}
    # 64 of 80 tokens on e1, 32 on e2: e1, though the busiest.
    assert policy.choose(SYSTEM + question, loads) == "e1"
    # 32 of 80 on e1 and on e2 alike (40% < 50%): the smallest trees are e2's and e3's (64
    # tokens each, e1 holds 80), and e3 is the less loaded of those.
    assert policy.choose(SYSTEM[:32] + question * 3, loads) == "e3"
    assert policy.choose(SYSTEM[:32] + question * 3, {"e1": 0, "e2": 1, "e3": 2}) == "e2"
    # A threshold of 0.4 follows them: the less loaded of the two.
    low = CacheAware(Thresholds(cache=0.4, balance_abs=4, balance_rel=1.5), trees)
    assert low.choose(SYSTEM[:32] + question * 3, loads) == "e2"
    # Imbalanced (e1 has 5 more than e3 and more than 1.5x): the least-loaded, e3.
    assert policy.choose(SYSTEM + question, {"e1": 5, "e2": 1, "e3": 0}) == "e3"


def test_cache_aware_remembers_what_it_routed_and_forgets_the_lost() -> None:
    policy = CacheAware(T)
    prompt = [*SYSTEM, 1, 2, 3]
    assert policy.choose(prompt, {"e1": 1, "e2": 0}) == "e2"
    policy.routed("e2", prompt, capacity=1000)
    assert policy.choose(prompt, {"e1": 0, "e2": 2}) == "e2"  # the same prompt: all of it
    policy.lost("e2")
    assert policy.choose(prompt, {"e1": 0, "e3": 2}) == "e1"
    assert policy.trees.executors() == []
    policy.routed("e1", prompt, capacity=1000)
    policy.flushed()
    assert policy.trees.nodes() == 0


def test_cache_aware_trees_are_bounded_by_the_executors_pool_or_the_flag() -> None:
    by_pool = CacheAware(T)
    by_pool.routed("e1", SYSTEM, capacity=32)
    assert by_pool.trees.tokens("e1") == 32
    by_flag = CacheAware(T, max_tree_tokens=16)
    by_flag.routed("e1", SYSTEM, capacity=32)
    assert by_flag.trees.tokens("e1") == 16


def test_round_robin_takes_turns_whatever_the_load_or_cache() -> None:
    policy = RoundRobin()
    chosen = []
    for _ in range(5):
        name = policy.choose(SYSTEM, {"b": 0, "a": 9, "c": 0})
        policy.routed(name, SYSTEM, 1000)
        chosen.append(name)
    assert chosen == ["a", "b", "c", "a", "b"]


def test_least_load_ignores_the_cache() -> None:
    policy = make_policy("least_load", T)
    assert type(policy) is Policy
    policy.routed("a", SYSTEM, 1000)
    assert policy.choose(SYSTEM, {"a": 1, "b": 0}) == "b"
    assert policy.choose(SYSTEM, {"a": 1, "b": 1}) == "a"


def test_methods_by_name() -> None:
    assert isinstance(make_policy("cache_aware", T), CacheAware)
    assert isinstance(make_policy("round_robin", T), RoundRobin)
    with pytest.raises(ValueError, match="unknown load balance method 'random'"):
        make_policy("random", T)
