"""`python -m loadtest.radix_ops`: CPU micro-benchmark of the radix cache's operations.

Sequences of --min-len..--max-len random tokens in --num-groups groups; each starts with a cut
of its group's shared prefix (half to all of it), so the tree branches at many depths. Phases,
each timed call by call: admit (match a sequence, then insert it with fresh slots), match of
cached sequences (full hits), match of random cuts (partial hits that split nodes), insert of
cached sequences, lock + unlock, and evict of --evict-tokens at a time until the tree is empty.
The garbage collector is off while timing, as in timeit (--keep-gc leaves it on).

    python -m loadtest.radix_ops --num-seqs 1000 --page-size 1
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch

from services.executor.cache import RadixCache
from services.executor.kv_pool import KVPool


def make_sequences(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    vocab = range(args.vocab_size)
    prefix_lens = [
        rng.randint(args.min_len // 2, args.max_len // 2) for _ in range(args.num_groups)
    ]
    prefixes = [rng.choices(vocab, k=n) for n in prefix_lens]
    seqs = []
    for _ in range(args.num_seqs):
        prefix = rng.choice(prefixes)
        head = prefix[: rng.randint(len(prefix) // 2, len(prefix))]
        total = rng.randint(args.min_len, args.max_len)
        seqs.append(head + rng.choices(vocab, k=max(0, total - len(head))))
    return seqs


class Timer:
    """The summed time of one phase's calls, and the tokens they covered."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.tokens = 0

    def add(self, t0: float, tokens: int) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.tokens += tokens

    def row(self) -> dict[str, float]:
        s = max(self.seconds, 1e-12)
        return {
            "calls": self.calls,
            "seconds": round(self.seconds, 6),
            "calls_per_s": round(self.calls / s, 1),
            "us_per_call": round(1e6 * self.seconds / max(self.calls, 1), 2),
            "tokens_per_s": round(self.tokens / s),
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    seqs = make_sequences(args, rng)
    pool = KVPool(sum(map(len, seqs)), 0, 1, 1, torch.float32, "cpu")  # no K/V buffers
    cache = RadixCache(pool, args.page_size)
    admit, insert_new, hit, cut, insert_cached, lock, evict = (Timer() for _ in range(7))
    clock = time.perf_counter

    for seq in seqs:  # admit: match, then insert the whole sequence with fresh slots
        t0 = clock()
        m = cache.match_prefix(seq)
        admit.add(t0, len(seq))
        slots = m.slots + pool.allocate(len(seq) - len(m.slots))
        t0 = clock()
        r = cache.insert(seq, slots)
        insert_new.add(t0, len(seq))
        pool.free(slots[len(m.slots) : r.cached_len] + slots[r.tree_len :])
    cached_tokens, nodes = cache.total_size(), count_nodes(cache)
    cache.check_integrity(in_use=0)

    order = rng.sample(seqs, len(seqs))
    for seq in order:
        t0 = clock()
        m = cache.match_prefix(seq)
        hit.add(t0, len(seq))
        t0 = clock()
        cache.insert(seq[: len(m.slots)], m.slots)  # whole pages only
        insert_cached.add(t0, len(m.slots))
        t0 = clock()
        cache.lock(m.node)
        cache.unlock(m.node)
        lock.add(t0, 0)  # walks nodes, not tokens
    for seq in order:
        key = seq[: rng.randint(1, len(seq))]
        t0 = clock()
        cache.match_prefix(key)
        cut.add(t0, len(key))
    nodes_after_splits = count_nodes(cache)
    cache.check_integrity(in_use=0)

    while cache.total_size():
        t0 = clock()
        freed = cache.evict(args.evict_tokens)
        evict.add(t0, freed)
    assert pool.num_free() == pool.num_slots
    cache.check_integrity(in_use=0)
    timers = {
        "match (admit)": admit,
        "insert (new)": insert_new,
        "match (hit)": hit,
        "match (cut, splits)": cut,
        "insert (cached)": insert_cached,
        "lock + unlock": lock,
        f"evict ({args.evict_tokens})": evict,
    }

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "bench": "radix_ops",
        "config": vars(args) | {"output_file": str(args.output_file)},
        "host": {"python": platform.python_version(), "machine": platform.machine()},
        "workload": {
            "tokens": sum(map(len, seqs)),
            "cached_tokens": cached_tokens,
            "nodes": nodes,
            "nodes_after_splits": nodes_after_splits,
        },
        "results": {name: t.row() for name, t in timers.items()},
    }


def count_nodes(cache: RadixCache) -> int:
    n, stack = 0, [cache.root]
    while stack:
        node = stack.pop()
        n += len(node.children)
        stack.extend(node.children.values())
    return n


def print_table(record: dict[str, Any]) -> None:
    w = record["workload"]
    c = record["config"]
    print(
        f"radix cache ops: {c['num_seqs']} sequences of {c['min_len']}-{c['max_len']} tokens, "
        f"page size {c['page_size']}: {w['tokens']:,} tokens, {w['cached_tokens']:,} cached "
        f"in {w['nodes']:,} nodes ({w['nodes_after_splits']:,} after the splitting matches)"
    )
    header = f"{'operation':<22}{'calls':>8}{'calls/s':>12}{'us/call':>11}{'tokens/s':>15}"
    print(header)
    print("-" * len(header))
    for name, r in record["results"].items():
        tokens = f"{r['tokens_per_s']:,}" if r["tokens_per_s"] else "-"
        print(
            f"{name:<22}{r['calls']:>8}{r['calls_per_s']:>12,.0f}{r['us_per_call']:>11,.1f}"
            f"{tokens:>15}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--num-seqs", type=int, default=1000)
    p.add_argument("--min-len", type=int, default=2000)
    p.add_argument("--max-len", type=int, default=8000)
    p.add_argument("--num-groups", type=int, default=40, help="distinct shared prefixes")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--evict-tokens", type=int, default=4096, help="tokens asked per evict call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-gc", action="store_true", help="leave the garbage collector on")
    p.add_argument("--output-file", type=Path, default=Path("results/radix_ops.jsonl"))
    args = p.parse_args(argv)
    if not 0 < args.min_len <= args.max_len:
        p.error("need 0 < --min-len <= --max-len")
    if not args.keep_gc:
        gc.disable()  # as timeit does: a collection would land in whichever call is timed
    record = run(args)
    gc.enable()
    print_table(record)
    args.output_file.parent.mkdir(parents=True, exist_ok=True)
    with args.output_file.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
