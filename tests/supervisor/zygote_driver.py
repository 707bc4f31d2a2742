"""Drives radixserve/spawner.py from a process of its own, as `radixserve serve` does (a test
process must not become a subreaper: every orphan of the suite would then be its child).
Reads one command a line on stdin and answers one JSON line:

    spawn INSTANCE SERVICE [FLAGS...]   {"pid": N}: `radixserve SERVICE` forked by the zygote
                                        ({"pid": null, "refused": why} if it forks nothing)
    signal PID SIG                      {}
    wait PID                            {"code": C}
    zygote                              {"pid": N}: the zygote's pid (started if need be)
    orphan                              {"pid": N}: a process left to this one by its parent
    reap PID...                         {"reaped": [...]}: reap_orphans, those PIDs known
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from radixserve.spawner import AdoptedProcess, Zygote, become_subreaper, reap_orphans


def main() -> None:
    if not become_subreaper():
        raise SystemExit("no PR_SET_CHILD_SUBREAPER here")
    zygote = Zygote(dict(os.environ))
    procs: dict[int, AdoptedProcess] = {}
    for line in sys.stdin:
        cmd, *args = line.split()
        answer: dict[str, object] = {}
        if cmd == "spawn":
            env = {**os.environ, "RADIXSERVE_INSTANCE_ID": args[0]}
            proc = zygote.spawn([sys.executable, "-m", "radixserve", *args[1:]], env)
            if proc is None:
                answer = {"pid": None, "refused": zygote.refused}
            else:
                procs[proc.pid] = proc
                answer = {"pid": proc.pid}
        elif cmd == "signal":
            procs[int(args[0])].send_signal(int(args[1]))
        elif cmd == "wait":
            answer = {"code": procs[int(args[0])].wait(120)}
        elif cmd == "zygote":
            zygote.start()
            assert zygote.proc is not None
            answer = {"pid": zygote.proc.pid}
        elif cmd == "orphan":
            # sh starts a sleeper and exits: the sleeper is orphaned, and adopted here
            sh = subprocess.run(
                ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
                capture_output=True,
                text=True,
                check=True,
            )
            answer = {"pid": int(sh.stdout)}
        elif cmd == "reap":
            answer = {"reaped": reap_orphans(int(a) for a in args)}
        print(json.dumps(answer), flush=True)
    zygote.close()
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    main()
