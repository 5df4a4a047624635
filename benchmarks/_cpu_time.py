"""CPU seconds of a command and of every process it started: ``user sys wall`` on stderr.

Usage: ``python benchmarks/_cpu_time.py python benchmarks/groups.py --quick``

``/usr/bin/time`` counts the command and the children it waited for. A forkserver
(``distoptim.launch``'s default start method) is not waited for: it outlives the launcher by a
moment, and with it go its imports and every process it forked. Here this process is the
subreaper of everything the command starts (Linux ``PR_SET_CHILD_SUBREAPER``): orphans are
re-parented to it and reaped by it, so their CPU time is counted too.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    t0 = time.monotonic()
    rc = subprocess.call(argv)
    while True:  # the orphans: re-parented here, each reaped once it ends
        try:
            os.wait()
        except ChildProcessError:
            break
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{ru.ru_utime:.2f} {ru.ru_stime:.2f} {time.monotonic() - t0:.2f}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
