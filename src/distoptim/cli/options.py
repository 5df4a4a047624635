"""Command-line arguments of ``distoptim train`` and ``distoptim compare``, and their checks.

Owns: the argument parser, and turning parsed arguments into a :class:`Plan` -- the list of
:class:`~distoptim.cli.train.RunConfig` to run, the loaded dataset, the output folder and the
emulated link -- with every check done before any process starts. Anything wrong raises
:class:`UsageError` whose one-line message the command line prints before exiting with code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from distoptim._version import __version__
from distoptim.cli.datasets import DIGITS, Dataset, DatasetError, load_dataset
from distoptim.cli.train import (
    ALGORITHMS,
    DEFAULT_LR,
    OPTIMIZERS,
    RunConfig,
    async_available,
)

__all__ = ["DEFAULTS", "Plan", "UsageError", "build_parser", "make_plan"]

DEFAULTS: dict[str, Any] = {
    "algos": list(ALGORITHMS),
    "workers": [4],
    "communication_period": [10],
    "epochs": 30,
    "batch_size": 16,
    "optimizer": "adam",
    "seed": 0,
    "repeats": 1,
    "num_ps": 1,
    "eval_points": 25,
    "timeout": 900.0,
    "out": "distoptim-results",
}
"""``distoptim compare`` with no arguments: 4 workers, λ = 10, 30 epochs of digits, batch 16
per worker, Adam (lr 0.001): every algorithm reaches > 94 % validation accuracy. (With SGD +
momentum 0.9 at lr 0.05, DOWNPOUR's un-normalized commits of 4 workers diverge -- the
instability the AGN paper is about; see ``--optimizer``/``--lr``.)"""


class UsageError(ValueError):
    """Bad command-line input; the message is one line saying what is wrong and what is allowed."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _int_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not an integer (give one, or a comma list like 2,4,8)"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= 1")
        values.append(value)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
    return values


def _algo_list(text: str) -> list[str]:
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in ALGORITHMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {', '.join(map(repr, bad)) or repr(text)} "
            f"(choose from {', '.join(ALGORITHMS)}, comma separated)"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} repeats an algorithm")
    return names


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= 1")
    return value


def _number(minimum: float, inclusive: bool) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        ok = math.isfinite(value) and (value >= minimum if inclusive else value > minimum)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"{text} is not allowed: must be a finite number {'>=' if inclusive else '>'} "
                f"{minimum:g}"
            )
        return value

    return parse


def _add_common(p: argparse.ArgumentParser, grid: bool) -> None:
    many = " (comma list sweeps a grid)" if grid else ""
    p.add_argument(
        "--workers",
        "-n",
        type=_int_list,
        default=DEFAULTS["workers"],
        metavar="N" + (",N..." if grid else ""),
        help=f"worker processes per run (default 4){many}",
    )
    p.add_argument(
        "--communication-period",
        "-l",
        type=_int_list,
        default=DEFAULTS["communication_period"],
        metavar="L" + (",L..." if grid else ""),
        help=f"λ / τ: local steps between commits of the async algorithms (default 10){many}; "
        "sync all-reduces every step",
    )
    p.add_argument(
        "--epochs",
        type=_positive_int,
        default=DEFAULTS["epochs"],
        help="passes over the training set, all workers together (default %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=DEFAULTS["batch_size"],
        metavar="B",
        help="samples per worker step; sync's global batch is workers x B (default %(default)s)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=DEFAULTS["optimizer"],
        help="torch optimizer every algorithm wraps (AGN's server runs the same kind): sgd, "
        "momentum (SGD, momentum 0.9) or adam (default %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=_number(0.0, inclusive=False),
        default=None,
        help="learning rate (default: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
        + ")",
    )
    p.add_argument(
        "--seed", type=int, default=DEFAULTS["seed"], help="model init and data order (default 0)"
    )
    p.add_argument(
        "--dataset",
        default=DIGITS,
        metavar="digits|PATH.npz",
        help="'digits' (scikit-learn's bundled 8x8 digits, default) or an .npz with arrays x, y",
    )
    p.add_argument(
        "--out",
        default=DEFAULTS["out"],
        metavar="DIR",
        help="where results.json and accuracy_vs_time.png go (default ./%(default)s/)",
    )
    p.add_argument(
        "--link-latency-ms",
        type=_number(0.0, inclusive=True),
        default=None,
        metavar="MS",
        help="emulate a slower network: delay every message by MS milliseconds (off by default)",
    )
    p.add_argument(
        "--link-mbps",
        type=_number(0.0, inclusive=False),
        default=None,
        metavar="MBPS",
        help="emulate a link of this bandwidth in megabit/s (off by default)",
    )
    p.add_argument(
        "--num-ps",
        type=_positive_int,
        default=DEFAULTS["num_ps"],
        help="parameter-server shards of the async algorithms (default 1)",
    )
    p.add_argument(
        "--eval-points",
        type=_positive_int,
        default=DEFAULTS["eval_points"],
        help="validation evaluations during each run (default %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=_number(0.0, inclusive=False),
        default=DEFAULTS["timeout"],
        metavar="S",
        help="seconds a run may take before its processes are stopped (default %(default)g)",
    )
    p.add_argument(
        "--progress",
        choices=("auto", "rich", "plain", "none"),
        default="auto",
        help="live progress on stderr: bars (rich) on a terminal, lines otherwise (default auto)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``distoptim`` parser with its ``train`` and ``compare`` commands."""
    parser = _Parser(
        prog="distoptim",
        description=(
            "Distributed optimizers from TensorFlow (CrossShardOptimizer, AGNOptimizer, "
            "DTensor SGD) on torch.distributed: train and compare them on real data."
        ),
    )
    parser.add_argument("--version", action="version", version=f"distoptim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="one training run of one algorithm",
        description="Train the MLP once with one algorithm and N local worker processes.",
    )
    train.add_argument(
        "--algo",
        type=_algo_list,
        required=True,
        help=f"the algorithm: {', '.join(ALGORITHMS)}",
    )
    _add_common(train, grid=False)
    compare = sub.add_parser(
        "compare",
        help="train under every algorithm and compare (the main job)",
        description=(
            "Train the same MLP under each algorithm (a grid over --algos x --workers x "
            "--communication-period), then print a table and write results.json and "
            "accuracy_vs_time.png."
        ),
    )
    compare.add_argument(
        "--algos",
        type=_algo_list,
        default=DEFAULTS["algos"],
        metavar="A,A...",
        help=f"algorithms to compare (default all: {','.join(ALGORITHMS)})",
    )
    compare.add_argument(
        "--repeats",
        type=_positive_int,
        default=DEFAULTS["repeats"],
        help="runs per cell; the table shows mean ± std of validation accuracy (async runs "
        "differ run to run, sync with one --seed does not) (default 1)",
    )
    _add_common(compare, grid=True)
    return parser


@dataclass
class Plan:
    """What to run: configs in order, the data, where outputs go, the emulated link."""

    command: str
    configs: list[RunConfig]
    data: Dataset
    out: str
    link: dict[str, float | None] | None
    link_env: str | None
    progress: str


def make_plan(args: argparse.Namespace, world_size: int | None = None) -> Plan:
    """Check everything and build the :class:`Plan`; raises :class:`UsageError`.

    ``world_size``: under torchrun, the number of processes torchrun started (``--workers``
    must agree or be left at its default).
    """
    if args.command == "train":
        algos = args.algo
        if len(algos) != 1:
            raise UsageError("train runs one algorithm; use 'distoptim compare --algos' for more")
        for flag, values in (
            ("--workers", args.workers),
            ("--communication-period", args.communication_period),
        ):
            if len(values) != 1:
                raise UsageError(f"train takes one value for {flag}; 'distoptim compare' sweeps")
        repeats = 1
    else:
        algos, repeats = args.algos, args.repeats
    workers = list(args.workers)
    if world_size is not None:  # torchrun decides: all ranks (sync), or all but the PS shards
        n = world_size if algos[0] == "sync" else world_size - args.num_ps
        if n < 1:
            raise UsageError(
                f"torchrun started {world_size} processes: {algos[0]} with --num-ps "
                f"{args.num_ps} needs at least {args.num_ps + 1}"
            )
        if workers not in (DEFAULTS["workers"], [n]):
            raise UsageError(
                f"--workers {workers[0]} disagrees with torchrun's {world_size} processes "
                f"({n} workers)"
            )
        workers = [n]
    if any(w > 256 for w in workers):
        raise UsageError(f"--workers {max(workers)} is too many for one machine (at most 256)")
    if any(a != "sync" for a in algos):
        why = async_available()
        if why is not None:
            bad = ", ".join(a for a in algos if a != "sync")
            raise UsageError(f"algorithm(s) {bad} unavailable: {why}")
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]

    configs = []
    for repeat in range(repeats):
        for algo in algos:
            periods = [1] if algo == "sync" else args.communication_period
            for n in workers:
                for lam in periods:
                    configs.append(
                        RunConfig(
                            algo=algo,
                            workers=n,
                            communication_period=lam,
                            epochs=args.epochs,
                            batch_size=args.batch_size,
                            optimizer=args.optimizer,
                            lr=lr,
                            seed=args.seed,
                            num_ps=args.num_ps,
                            eval_points=args.eval_points,
                            timeout=args.timeout,
                            repeat=repeat,
                        )
                    )

    link = link_env = None
    if args.link_latency_ms is not None or args.link_mbps is not None:
        from distoptim.comm.link import Link

        try:
            emulated = Link(args.link_latency_ms or 0.0, args.link_mbps)
        except ValueError as exc:
            raise UsageError(f"link emulation: {exc}") from None
        link = {"latency_ms": emulated.latency_ms, "mbps": emulated.mbps}
        link_env = emulated.to_env()

    try:
        data = load_dataset(args.dataset)
    except DatasetError as exc:
        raise UsageError(str(exc)) from None
    n_train = int(data.x_train.shape[0])
    for cfg in configs:
        if cfg.steps_per_epoch(n_train) < 1:
            raise UsageError(
                f"dataset too small: {cfg.workers} workers get {n_train // cfg.workers} training "
                f"samples each per epoch, fewer than --batch-size {cfg.batch_size}"
            )

    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {args.out!r} exists and is not a directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out!r}: cannot create it ({exc.strerror})") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {args.out!r} is not writable")
    return Plan(args.command, configs, data, out, link, link_env, args.progress)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv`` (exits 2 with one line on a syntax error)."""
    return build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
