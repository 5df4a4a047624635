"""Entry point of the ``distoptim`` console script: argument parsing and dispatch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from distoptim._version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distoptim",
        description=(
            "Distributed optimizers from TensorFlow (CrossShardOptimizer, AGNOptimizer, "
            "DTensor SGD) on torch.distributed: train and compare them on real data."
        ),
    )
    parser.add_argument("--version", action="version", version=f"distoptim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("compare", help="compare the algorithms on the bundled digits dataset")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    print(f"distoptim {__version__}: '{args.command}' arrives with the command-line issue.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
