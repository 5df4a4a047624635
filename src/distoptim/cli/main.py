"""Entry point of the ``distoptim`` console script: parse, check, dispatch, exit code.

``distoptim compare`` (the main job) and ``distoptim train`` run locally with worker processes
this command starts; ``distoptim lighthouse`` runs torchft's lighthouse for fault-tolerant jobs
(:mod:`distoptim.ft.lighthouse`); ``python -m distoptim.cli.train`` under ``torchrun`` runs
one rank of the same training (:func:`torchrun_train`). Exit codes: 0 done, 1 a run failed,
2 bad arguments (one line on stderr, no traceback), 130 interrupted by Ctrl-C, 143 stopped by
SIGTERM, 129 by SIGHUP (a closed terminal; all three keep the results so far).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "torchrun_train"]


def _usage_error(command: str | None, message: str) -> int:
    prog = "distoptim" + (f" {command}" if command else "")
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    from distoptim.cli import outdir
    from distoptim.cli.arguments import UsageError, build_parser, make_plan
    from distoptim.cli.session import run_plan
    from distoptim.cli.stopping import exit_code, flush_or_drop, signals_as_interrupt
    from distoptim.launch import exit_if_bootstrapping

    exit_if_bootstrapping()  # a script without a main guard, re-imported by a worker process
    started = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lighthouse"]:  # torchft's lighthouse for fault-tolerant jobs
        from distoptim.ft.lighthouse import main as lighthouse

        return lighthouse(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version (0) or a one-line error (2)
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 0
    with signals_as_interrupt():
        try:
            try:
                plan = make_plan(args)
            except UsageError as exc:
                return _usage_error(args.command, str(exc))
            if plan.fault_tolerant is not None:
                from distoptim.cli.ftsession import run_fault_tolerant_plan

                return run_fault_tolerant_plan(plan, argv)
            return run_plan(plan, argv, started=started)
        except KeyboardInterrupt as exc:  # during the checks, or printing the table
            with contextlib.suppress(OSError, ValueError):
                print("distoptim: interrupted", file=sys.stderr)
            return exit_code(exc)
        finally:
            outdir.release()
            flush_or_drop()


def torchrun_train(argv: Sequence[str]) -> int:
    """One rank of ``torchrun -m distoptim.cli.train ...``: the training on torchrun's ranks.

    The reporting rank (collective algorithms: rank 0; server algorithms: the first worker,
    rank ``--num-ps``) writes ``results.json`` and the plot to ``--out`` and prints the table;
    the other ranks print nothing and create no folder.
    """
    from distoptim.cli import algorithms
    from distoptim.cli.arguments import UsageError, build_parser, make_plan
    from distoptim.cli.session import run_torchrun_plan
    from distoptim.netcheck import check_torchrun_network

    parser = build_parser()
    try:
        args = parser.parse_args(["train", *argv])
    except SystemExit as exc:
        return int(exc.code or 0)
    server = algorithms.get(args.algo[0]).family == "server"
    reporting = int(os.environ["RANK"]) == (args.num_ps if server else 0)
    try:
        plan = make_plan(args, world_size=int(os.environ["WORLD_SIZE"]), writes=reporting)
    except UsageError as exc:
        return _usage_error("train", str(exc))
    check_torchrun_network("distoptim.cli.train", ("gloo",), plan.configs[0].timeout)
    return run_torchrun_plan(plan, ["train", *argv])


if __name__ == "__main__":
    sys.exit(main())
