"""`python -m services.executor.distributed.rank --tp-rank R <executor flags>`: one rank of an
executor group after its node's first, started by that one (ranks.py)."""

from __future__ import annotations

from services.executor.distributed.node import exit_rank, layout_of, run_rank
from services.executor.flags import add_flags
from shared.config import EnvArgumentParser, add_common_flags
from shared.logs import setup_logging


def main(argv: list[str] | None = None) -> None:
    p = EnvArgumentParser(prog="radixserve executor (rank)", description=__doc__)
    add_common_flags(p)
    add_flags(p)
    p.add_argument("--tp-rank", type=int, required=True, help="this process's rank in the group")
    a = p.parse_args(argv)
    setup_logging("executor", f"{a.instance_id or 'executor'}-rank{a.tp_rank}", a.log_level)
    exit_rank(run_rank(a, layout_of(a), a.tp_rank, a.dist_init_addr, []))


if __name__ == "__main__":
    main()
