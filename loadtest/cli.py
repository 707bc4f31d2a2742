"""`radixserve-loadtest <command>`: the benchmarks and stress tools of loadtest/ behind one
console script."""

from __future__ import annotations

import argparse
import sys

USAGE = """usage: radixserve-loadtest <command> [flags]

commands:
  serving   benchmark a running server (flags as in SGLang's bench_serving)
  burst     N requests at once to a running server: status counts, Retry-After, latency
  lang      radixserve.lang programs (few-shot select, tree-of-thought fork, multi-turn chat)
            on an Engine with the radix cache on and off: programs/s and cache hit rate
  protocols gRPC against HTTP on one running server: one-token latency at concurrency 1
            and 64, decode-heavy output tok/s
  dp        the shared-prefix workload against one executor and --dp-size executors per
            --load-balance-method (a fresh serve each): cache hit rate and throughput
  tp        tensor parallelism on the CPU (gloo): one rank against --tp-size ranks, the same
            tokens?, and the collectives' share of rank 0's step time
  hoststep  the host's time per decode step at batch 256 on the CPU (the real engine, a
            stand-in model), per phase
  faults    start a stack and break it (each service killed, Redis restarted, hostile input)
            under a steady load: ok / retried / failed-fast / hung per scenario

`radixserve-loadtest <command> --help` lists a command's flags.
"""


def _burst(argv: list[str]) -> None:
    from loadtest import burst

    p = argparse.ArgumentParser(prog="radixserve-loadtest burst", description=burst.__doc__)
    burst.add_arguments(p)
    burst.run(p.parse_args(argv))


def _serving(argv: list[str]) -> None:
    from loadtest import serving

    serving.main(argv)


def _faults(argv: list[str]) -> None:
    from loadtest import faults

    faults.main(argv)


def _dp(argv: list[str]) -> None:
    from loadtest import dp_bench

    dp_bench.main(argv)


def _lang(argv: list[str]) -> None:
    from loadtest import lang_bench

    lang_bench.main(argv)


def _protocols(argv: list[str]) -> None:
    from loadtest import protocols

    protocols.main(argv)


def _hoststep(argv: list[str]) -> None:
    from loadtest import host_step

    host_step.main(argv)


def _tp(argv: list[str]) -> None:
    from loadtest import tp_cpu

    tp_cpu.main(argv)


COMMANDS = {
    "tp": _tp,
    "hoststep": _hoststep,
    "serving": _serving,
    "burst": _burst,
    "faults": _faults,
    "dp": _dp,
    "lang": _lang,
    "protocols": _protocols,
}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if args else 2)
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"radixserve-loadtest: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    command(args[1:])
