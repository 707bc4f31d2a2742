"""Dataset generators: requested lengths (measured with a real BPE), shared prefixes, JSONL."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from loadtest import datasets
from loadtest.backends import flatten
from loadtest.runner import initial_messages
from loadtest.textgen import TextSource


def encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def near(count: int, target: int) -> bool:
    """Within tokenizer drift: the cut points may re-tokenize a token or two differently."""
    return abs(count - target) <= max(2, target // 20)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prompt_of(conv: datasets.Conversation) -> str:
    return flatten([*initial_messages(conv), {"role": "user", "content": conv.turns[0].user}])


def test_random_lengths_are_uniform_in_range_and_re_tokenize_to_about_that(
    bpe: Tokenizer, source: TextSource
) -> None:
    convs = datasets.random_dataset(source, random.Random(0), 200, 300, 50, range_ratio=0.5)
    assert len(convs) == 200
    ins = [c.turns[0].user_len for c in convs]
    outs = [c.turns[0].output_len for c in convs]
    assert min(ins) >= 150 and max(ins) <= 300 and max(ins) - min(ins) > 100
    assert min(outs) >= 25 and max(outs) <= 50
    for c in convs:
        assert near(len(encode(bpe, c.turns[0].user)), c.turns[0].user_len)


def test_random_is_deterministic_and_prompts_share_no_prefix(bpe: Tokenizer) -> None:
    def make(seed: int) -> list[datasets.Conversation]:
        return datasets.random_dataset(TextSource(bpe, seed), random.Random(seed), 30, 64, 8, 1.0)

    assert make(3) == make(3)
    assert make(3) != make(4)
    ids = [encode(bpe, c.turns[0].user) for c in make(3)]
    assert all(len(i) == 64 or near(len(i), 64) for i in ids)
    assert max(common_prefix(a, b) for a in ids for b in ids if a is not b) < 8


def test_range_ratio_one_gives_fixed_lengths(source: TextSource) -> None:
    convs = datasets.random_dataset(source, random.Random(0), 10, 32, 16, range_ratio=1.0)
    assert {(c.turns[0].user_len, c.turns[0].output_len) for c in convs} == {(32, 16)}
    with pytest.raises(ValueError, match="range ratio"):
        datasets.uniform_lengths(random.Random(0), 1, 10, 1.5)


def test_shared_prefix_groups_share_their_system_prompt_token_for_token(
    bpe: Tokenizer, source: TextSource
) -> None:
    groups, per_group, system_len, question_len = 3, 5, 120, 20
    convs = datasets.shared_prefix_dataset(
        source, random.Random(0), groups, per_group, system_len, question_len, output_len=7
    )
    assert len(convs) == groups * per_group
    systems = list(dict.fromkeys(c.system for c in convs))
    assert len(systems) == groups
    order = [systems.index(c.system) for c in convs]
    assert order != sorted(order)  # shuffled
    for system in systems:
        group = [encode(bpe, prompt_of(c)) for c in convs if c.system == system]
        assert len(group) == per_group
        system_ids = encode(bpe, system or "")
        assert near(len(system_ids), system_len)
        for ids in group:
            assert ids[: len(system_ids)] == system_ids  # the whole system prompt is a prefix
            assert near(len(ids) - len(system_ids), question_len + 1)  # + the separator
        assert (
            min(common_prefix(a, b) for a in group for b in group if a is not b)
            < len(system_ids) + 8
        )  # the questions differ right after it
    firsts = [encode(bpe, prompt_of(convs[order.index(g)])) for g in range(groups)]
    assert max(common_prefix(a, b) for a in firsts for b in firsts if a is not b) < 8
    assert {c.turns[0].output_len for c in convs} == {7}


def test_multi_turn_has_fresh_user_messages_of_the_turn_length(
    bpe: Tokenizer, source: TextSource
) -> None:
    convs = datasets.multi_turn_dataset(source, 4, 3, turn_input_len=40, output_len=9)
    assert [len(c.turns) for c in convs] == [3, 3, 3, 3]
    users = [t.user for c in convs for t in c.turns]
    assert len(set(users)) == 12
    assert all(near(len(encode(bpe, u)), 40) for u in users)
    assert {t.output_len for c in convs for t in c.turns} == {9}


def test_json_requests_carry_a_schema_and_the_input_length(
    bpe: Tokenizer, source: TextSource
) -> None:
    convs = datasets.json_dataset(source, random.Random(0), 20, 80, 30, range_ratio=1.0)
    assert all(c.json_schema in [s for _, s in datasets.SCHEMAS] for c in convs)
    assert len({json.dumps(c.json_schema) for c in convs}) > 1
    for c in convs:
        assert c.turns[0].user.endswith(".") and "JSON object" in c.turns[0].user
        assert near(len(encode(bpe, c.turns[0].user)), 80)


def test_jsonl_prompts_and_messages(tmp_path: Path, source: TextSource) -> None:
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "Tell me a story.", "output_len": 12},
        {"prompt": "No length given."},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"},
            ]
        },
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    convs = datasets.jsonl_dataset(path, source, num_prompts=0, default_output_len=33)
    assert [c.turns[0].output_len for c in convs] == [12, 33, 33]
    assert convs[0].turns[0].user == "Tell me a story."
    assert convs[0].turns[0].user_len == source.count("Tell me a story.")
    chat = convs[2]
    assert chat.system == "Be brief." and chat.turns[0].user == "Bye"
    assert chat.history == (
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    )
    assert len(datasets.jsonl_dataset(path, source, num_prompts=2, default_output_len=1)) == 2

    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1"):
        datasets.jsonl_dataset(path, source, num_prompts=0, default_output_len=1)
