"""The offline throughput run's prompts: token ids and output lengths from a seeded RNG, the
same for the internal path and the public Engine's."""

from __future__ import annotations

import argparse
import random


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Ids in [10, vocab), one draw each whatever `vocab` is: runs with different vocabularies
    (the internal path's model, the public path's tokenizer) get the same lengths after them."""
    return [10 + int(rng.random() * (vocab - 10)) for _ in range(n)]


def throughput_prompts(
    rng: random.Random, a: argparse.Namespace, vocab: int
) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of each of `a.num_prompts` requests, lengths uniform in
    [len * range_ratio, len]."""

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * a.range_ratio)), n)

    return [
        (random_ids(rng, length(a.input_len), vocab), length(a.output_len))
        for _ in range(a.num_prompts)
    ]
