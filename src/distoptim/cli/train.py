"""``python -m distoptim.cli.train``: one rank of a torchrun job, or ``distoptim train``.

Under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process runs one rank of the training
(:func:`distoptim.cli.main.torchrun_train`); otherwise it is the same as ``distoptim train``.
On node n, address HOSTn (``is_host=true`` on node 0 only; ``docs/multinode.md`` says why each
flag is needed)::

    GLOO_SOCKET_IFNAME=eth0 TP_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 4 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true \\
        --local-addr HOSTn -m distoptim.cli.train --algo sync --epochs 30 --out results/
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from distoptim.cli import main as cli_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch on torchrun's environment; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return cli_main.main(["train", *argv])
    return cli_main.torchrun_train(argv)


if __name__ == "__main__":
    sys.exit(main())
