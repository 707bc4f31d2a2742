"""`radixserve <command>`: run everything (`serve`) or one service, as compose.yaml does."""

from __future__ import annotations

import importlib
import sys

# command -> module with main(argv); imported lazily so `radixserve gateway` never loads torch.
COMMANDS = {
    "serve": "radixserve.launcher",
    "gateway": "services.gateway.main",
    "tokenizer": "services.tokenizer.main",
    "grammar": "services.grammar.main",
    "scheduler": "services.scheduler.main",
    "executor": "services.executor.main",
    "detokenizer": "services.detokenizer.main",
}

USAGE = """usage: radixserve <command> [flags]

commands:
  serve        start Redis (unless REDIS_URL is set) and every service on this machine
  gateway      the HTTP API (OpenAI-compatible and native)
  tokenizer    chat templates and tokenization (scale with replicas)
  grammar      compiles structured-output constraints, cached in Redis (scale with replicas)
  scheduler    admission and routing to executors
  executor     the model on one GPU (or the CPU)
  detokenizer  token ids to text deltas

`radixserve <command> --help` lists a command's flags; each flag has a RADIXSERVE_* twin.
"""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if args else 2)
    if args[0] in ("-V", "--version"):
        from radixserve import __version__

        print(f"radixserve {__version__}")
        return
    module = COMMANDS.get(args[0])
    if module is None:
        print(f"radixserve: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    importlib.import_module(module).main(args[1:])
