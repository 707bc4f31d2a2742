"""The scheduler's per-executor trees of routed prefixes: exact cases, then properties."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.prefix_tree import PrefixTrees

BIG = 10**6


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_matches_whole_blocks_of_a_longer_prompt_and_an_identical_prompt_in_full() -> None:
    t = PrefixTrees(block=4)
    t.insert("e1", seq(0, 10), BIG)  # blocks [0..4) [4..8) and the partial [8, 9]
    assert t.match(seq(0, 10)) == {"e1": 10}  # the same prompt: partial block included
    assert t.match(seq(0, 20)) == {"e1": 8}  # longer: only the whole blocks
    assert t.match(seq(0, 7)) == {"e1": 4}  # shorter: [4, 5, 6] is no node
    assert t.match([*seq(0, 4), 99, 5, 6, 7]) == {"e1": 4}  # diverges inside block two
    assert t.match(seq(1, 10)) == {}
    assert t.tokens("e1") == 10
    t.check()


def test_one_trie_many_holders_each_matched_on_its_own() -> None:
    t = PrefixTrees(block=4)
    t.insert("e1", seq(0, 8), BIG)
    t.insert("e2", seq(0, 16), BIG)
    assert t.match(seq(0, 16)) == {"e1": 8, "e2": 16}
    assert t.nodes() == 4  # the shared blocks are stored once
    t.drop("e2")
    assert t.match(seq(0, 16)) == {"e1": 8}
    assert (t.nodes(), t.tokens("e2"), t.executors()) == (2, 0, ["e1"])
    t.check()
    t.clear()
    assert (t.nodes(), t.match(seq(0, 16)), t.executors()) == (0, {}, [])


def test_the_bound_evicts_the_least_recently_routed_leaves_first() -> None:
    t = PrefixTrees(block=4)
    a, b, c = seq(0, 8), seq(100, 8), seq(200, 8)
    t.insert("e1", a, 16)
    t.insert("e1", b, 16)
    t.insert("e1", a, 16)  # a is the more recent now
    t.insert("e1", c, 16)  # 24 tokens: b goes, leaf first, then its parent
    assert t.match(a) == {"e1": 8} and t.match(c) == {"e1": 8} and t.match(b) == {}
    assert t.tokens("e1") == 16
    t.insert("e1", seq(0, 12), 16)  # a's path grows by a block; c's leaf is the oldest
    assert t.match(seq(0, 12)) == {"e1": 12} and t.match(c) == {"e1": 4}
    t.check()


def test_a_prompt_longer_than_the_bound_keeps_its_head() -> None:
    t = PrefixTrees(block=4)
    t.insert("e1", seq(0, 20), 8)
    assert t.match(seq(0, 20)) == {"e1": 8} and t.tokens("e1") == 8
    t.check()


def test_another_executors_eviction_leaves_the_shared_nodes() -> None:
    t = PrefixTrees(block=4)
    t.insert("e1", seq(0, 8), BIG)
    t.insert("e2", seq(0, 8), 8)
    t.insert("e2", seq(50, 8), 8)  # e2 forgets seq(0, 8); e1 still holds it
    assert t.match(seq(0, 8)) == {"e1": 8}
    assert t.match(seq(50, 8)) == {"e2": 8}
    t.check()


# A small alphabet and block make prompts share prefixes often.
prompts = st.lists(st.integers(0, 2), min_size=0, max_size=24)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from(["e1", "e2", "e3"]), prompts),
        st.tuples(st.just("drop"), st.sampled_from(["e1", "e2", "e3"]), st.just([])),
    ),
    max_size=40,
)
BOUNDS = {"e1": 6, "e2": 13, "e3": 40}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(ops, prompts)
def test_trees_stay_within_their_bound_and_never_match_more_than_was_inserted(
    steps: list[tuple[str, str, list[int]]], probe: list[int]
) -> None:
    t = PrefixTrees(block=3)
    inserted: dict[str, list[list[int]]] = {e: [] for e in BOUNDS}  # since the last drop
    for op, executor, tokens in steps:
        if op == "insert":
            t.insert(executor, tokens, BOUNDS[executor])
            inserted[executor].append(tokens)
            assert t.tokens(executor) <= BOUNDS[executor]
            # What was just routed is held: all of it, or the whole blocks of its head that
            # the bound leaves room for.
            bound = BOUNDS[executor]
            want = len(tokens) if len(tokens) <= bound else bound // t.block * t.block
            assert t.match(tokens).get(executor, 0) == want
        else:
            t.drop(executor)
            inserted[executor] = []
        t.check()
        for query in (probe, tokens):
            for e, matched in t.match(query).items():
                # The match is a prefix of something routed to e, never longer.
                assert any(query[:matched] == s[:matched] for s in inserted[e])
                assert matched <= max(common_prefix(query, s) for s in inserted[e])
    assert all(t.tokens(e) <= bound for e, bound in BOUNDS.items())
