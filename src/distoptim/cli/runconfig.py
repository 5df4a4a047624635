"""What one run is: the command line's constants and :class:`RunConfig`.

Owns: the defaults of ``distoptim train`` / ``distoptim compare`` (the digits job's, and the
language model's where they differ: :data:`LM_DEFAULTS`), the choices of the options that are
not algorithms (model, torch optimizer, AGN rule, EASGD moving rate, the outer optimizer of the
DiLoCo family, wire formats, the parameter server's transport, emulated stragglers), and the
frozen :class:`RunConfig` every process of a run receives. The algorithms themselves
(names, how each is built, what it records) are :mod:`distoptim.cli.algorithms`; the epoch
plan (shards, batches) is :mod:`distoptim.cli.datasets`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distoptim.agn.transport import TRANSPORTS  # --transport: p2p (the library's default), rpc
from distoptim.checks import check_bool, check_choice, check_int, check_positive, check_real
from distoptim.cli.datasets import batches_per_epoch, shard_size
from distoptim.comm.wire import NAMES as WIRES  # --wire: these, and topk:D[+V]
from distoptim.comm.wire import parse_wire

__all__ = [
    "AGN_RULES",
    "DEFAULTS",
    "DEFAULT_HIDDEN",
    "DEFAULT_LR",
    "LM_DEFAULTS",
    "MAX_SEED",
    "MODELS",
    "MOVING_RATE_RULES",
    "OPTIMIZERS",
    "TRANSPORTS",
    "WIRES",
    "RunConfig",
    "delayed_nesterov",
    "easgd_alpha",
    "straggler_factor",
]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
DEFAULT_LR = {"sgd": 0.05, "momentum": 0.01, "adam": 0.001, "adamw": 0.001}
"""Per-optimizer learning rate when ``--lr`` is not given (tuned on digits, see docs/cli.md);
the language model's are :data:`LM_DEFAULTS` ``["lr"]``."""

MODELS = ("mlp", "gpt")
"""``--model``: ``mlp`` (feature vectors -> classes: digits, mnist5k, .npz; the default there)
or ``gpt`` (the causal transformer of :mod:`distoptim.cli.gpt`: ``--dataset shakespeare``,
its default there)."""

AGN_RULES = {"paper": "delta", "tf": "gradient"}
"""``--agn-rule`` -> ``AGNOptimizer(update_rule=...)``.

* ``paper`` (default): Hermans et al.'s rule (``update_rule="delta"``): the worker commits
  ``(θ - θ_pulled) / λ`` and the server adds it. The 1/λ normalization acts on the center.
* ``tf``: TF contrib's rule (``update_rule="gradient"``): the worker commits the accumulated
  gradient ``a / λ`` and the server runs its own copy of the optimizer on it. With Adam (the
  default optimizer) the server step is scale-invariant, so 1/λ has no effect.
"""

MOVING_RATE_RULES = {"paper": "0.9/n", "tf": "0.9/(τ·n)"}
"""``--moving-rate``: EASGD's alpha by rule, or a number in (0, 1].

* ``paper`` (default): alpha = β/n with β = 0.9: Zhang et al. tie the moving rate to the
  number of workers (β = n·alpha) and use β = 0.9.
* ``tf``: TF contrib's default alpha = 0.9/(τ·n); it makes the elastic pull vanish as τ·n grows
  (n = 8, τ = 40: alpha = 0.0028, the center barely moves).
"""

DEFAULT_HIDDEN = (128, 64)
"""Hidden layer widths: small enough that 4 workers share 2 cores, big enough for > 95 % on
digits. The AGN thesis' MNIST model is ``--hidden 1000,2000,1000``."""

DEFAULTS: dict[str, Any] = {
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
    "agn_rule": ["paper"],
    "moving_rate": "paper",
    "hidden": DEFAULT_HIDDEN,
    "out": "distoptim-results",
    "outer_lr": 1.0,
    "outer_momentum": 0.5,
    "fragments": 2,
    "fragment_sync_delay": 1,
    "fragment_alpha": 0.5,
    "transport": "p2p",
    "delayed_momentum": "n",
}
"""``distoptim compare`` with no arguments: 4 workers, λ = 10, 30 epochs of digits, batch 16
per worker, Adam (lr 0.001). The outer optimizer of the DiLoCo family is Nesterov SGD at lr 1.0,
momentum 0.5 rather than DiLoCo's paper's 0.7 / 0.9: on digits (n = 4, H = 10, 4 seeds) it kept
DiLoCo within 1 point of sync's accuracy in 4 of 4 seeds, the paper's in 1 of 4 (docs/cli.md).
Sync, DOWNPOUR and EASGD reach about 96-97 % validation accuracy, AGN with the paper's rule
(commits normalized by λ, so the center moves more slowly) about 93 %; AGN is the one that
stays stable as n and λ grow (docs/cli.md)."""

LM_DEFAULTS: dict[str, Any] = {
    "epochs": 0.2,
    "lr": {"sgd": 0.05, "momentum": 0.01, "adam": 0.003, "adamw": 0.003},
    "eval_points": 10,
    "layers": 2,
    "width": 128,
    "heads": 4,
    "context": 64,
    "algos": [
        "sync",
        "localsgd",
        "diloco",
        "diloco@int4",
        "diloco@topk:0.02+int2",
        "streaming-diloco",
        "agn",
        "downpour",
        "easgd",
        "async-diloco",
    ],
}
"""``distoptim compare --dataset shakespeare`` where it differs from :data:`DEFAULTS`: a fifth
of a pass over the training text (all workers together: 208 steps of 16 windows per worker
with 4 workers), Adam at lr 3e-3 (``benchmarks/lm_size.py``: 1.815 nats after 1,500 steps vs
1.867 at 1e-3; the SGD rates are the digits' and not tuned for the transformer), 10
evaluations per run (each scores 16,384 validation characters, about 0.6 s of a core, inside
the wall time), the default GPT (2 layers x 128, 4 heads, context 64), and every algorithm plus
the compressed outer-family variants (docs/cli.md)."""


def straggler_factor(stragglers: tuple[tuple[int, float], ...], worker: int) -> float:
    """How many times as long worker ``worker``'s steps take (1.0 when it is no straggler)."""
    return dict(stragglers).get(worker, 1.0)


def delayed_nesterov(rule: str, workers: int) -> int:
    """``--delayed-momentum``: ``"n"`` -> the number of workers (Liu et al.'s choice), else the
    count itself (``"0"``: Nesterov on every commit); ``ValueError`` otherwise."""
    if rule == "n":
        return workers
    if isinstance(rule, str) and rule.isdigit():
        return int(rule)
    raise ValueError(f"delayed_momentum must be 'n' or an integer >= 0, got {rule!r}")


def easgd_alpha(rule: str, workers: int, period: int) -> float:
    """EASGD's moving rate alpha for ``--moving-rate rule`` with n workers and period τ."""
    if rule == "paper":
        return 0.9 / workers
    if rule == "tf":
        return 0.9 / (period * workers)
    value = float(rule)
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"moving rate must be 'paper', 'tf' or a number in (0, 1], got {rule!r}")
    return value


MAX_SEED = 2**32 - 1
"""The largest ``--seed``: numpy's range; every generator a run seeds takes it (the data order
seeds ``seed * 100_003 + epoch``, far inside torch's 64 bits)."""

_COUNTS = (
    ("workers", 1),
    ("communication_period", 1),
    ("batch_size", 1),
    ("num_ps", 1),
    ("fragments", 1),
    ("eval_points", 1),
    ("fragment_sync_delay", 0),
    ("layers", 1),
    ("width", 1),
    ("heads", 1),
    ("context", 1),
)
"""The integer fields of :class:`RunConfig` and their least value."""


def _checked(check: Any, name: str, value: Any, *bounds: Any, allowed: str, **kw: Any) -> None:
    """``check(name, value, *bounds, **kw)`` from :mod:`distoptim.checks`, refused in the words
    ``distoptim`` prints for a value its parser let through (``--outer-momentum 1``:
    "outer_momentum must be in [0, 1), got 1.0")."""
    try:
        check(name, value, *bounds, **kw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {allowed}, got {value!r}") from None


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs; validated by the command line before any process starts.

    ``communication_period`` is λ (AGN, DOWNPOUR), τ (EASGD) or H (LocalSGD and the DiLoCo
    family: inner steps between syncs); algorithms that do not use it keep 1. ``agn_rule`` and
    ``moving_rate`` matter only to AGN and EASGD; ``outer_lr`` and ``outer_momentum`` (the outer
    optimizer: SGD with Nesterov momentum) to the DiLoCo family; ``fragments``,
    ``fragment_sync_delay`` and ``fragment_alpha`` to Streaming DiLoCo; ``wire`` (None: the
    algorithm's own default) to DiLoCo and Streaming DiLoCo; ``delayed_momentum`` (Delayed
    Nesterov's N as given: ``"n"`` for the number of workers, or a count, ``"0"`` off; resolved
    by :attr:`delayed_nesterov`) and ``dylu`` (Dynamic Local Updates) to asynchronous DiLoCo;
    ``transport`` to the parameter-server algorithms. ``stragglers``: ``(worker, factor)``
    pairs, each such worker's steps take ``factor`` times as long (emulated,
    :mod:`distoptim.cli.training`).

    ``model`` is ``mlp`` (sized by ``hidden``) or ``gpt`` (sized by ``layers``, ``width``,
    ``heads``, ``context``; the other's sizes are unused). ``epochs`` counts passes over the
    training data, all workers together: a whole number for the classification datasets, any
    positive number for the language model (``0.05``: the first 5 % of an epoch's steps).
    ``seed`` is an integer in ``[0, 2**32 - 1]`` (numpy's range).
    """

    algo: str
    workers: int
    communication_period: int
    epochs: float
    batch_size: int
    optimizer: str
    lr: float
    seed: int
    num_ps: int = 1
    eval_points: int = 25
    timeout: float = 900.0
    repeat: int = 0
    hidden: tuple[int, ...] = DEFAULT_HIDDEN
    agn_rule: str = "paper"
    moving_rate: str = "paper"
    outer_lr: float = 1.0
    outer_momentum: float = 0.5
    fragments: int = 2
    fragment_sync_delay: int = 1
    fragment_alpha: float = 0.5
    wire: str | None = None
    transport: str = "p2p"
    stragglers: tuple[tuple[int, float], ...] = ()
    delayed_momentum: str = "n"
    dylu: bool = False
    model: str = "mlp"
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64

    def __post_init__(self) -> None:
        check_choice("optimizer", self.optimizer, OPTIMIZERS, fold_case=False)
        check_choice("model", self.model, MODELS, fold_case=False)
        for name, low in _COUNTS:
            _checked(check_int, name, getattr(self, name), low, allowed=f"an integer >= {low}")
        _checked(check_real, "epochs", self.epochs, 0.0, low_open=True, allowed="a number > 0")
        _checked(check_int, "seed", self.seed, 0, allowed=f"an integer in [0, {MAX_SEED}]")
        if self.seed > MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        check_positive("lr", self.lr)
        if not self.hidden or any(int(h) < 1 for h in self.hidden):
            raise ValueError(f"hidden must be one or more widths >= 1, got {self.hidden!r}")
        check_choice("agn_rule", self.agn_rule, AGN_RULES, fold_case=False)
        easgd_alpha(self.moving_rate, self.workers, self.communication_period)
        check_positive("outer_lr", self.outer_lr)
        momentum, alpha = self.outer_momentum, self.fragment_alpha
        _checked(check_real, "outer_momentum", momentum, 0, 1, high_open=True, allowed="in [0, 1)")
        _checked(check_real, "fragment_alpha", alpha, 0, 1, allowed="in [0, 1]")
        if self.wire is not None:
            parse_wire(self.wire)
        delayed_nesterov(self.delayed_momentum, self.workers)
        check_bool("dylu", self.dylu)
        check_choice("transport", self.transport, TRANSPORTS, fold_case=False)
        for worker, factor in self.stragglers:
            if not 0 <= worker < self.workers:
                raise ValueError(
                    f"straggler {worker} is not a worker of a run with {self.workers} workers "
                    f"(0..{self.workers - 1})"
                )
            if not (math.isfinite(factor) and factor >= 1):
                raise ValueError(f"straggler factor must be a number >= 1, got {factor!r}")

    @property
    def delayed_nesterov(self) -> int:
        """Async DiLoCo's Delayed Nesterov N for this run (0: off)."""
        return delayed_nesterov(self.delayed_momentum, self.workers)

    @property
    def easgd_alpha(self) -> float:
        """EASGD's alpha for this run (see :data:`MOVING_RATE_RULES`)."""
        return easgd_alpha(self.moving_rate, self.workers, self.communication_period)

    def steps_per_epoch(self, num_train: int) -> int:
        """Local steps each worker takes per epoch: its shard in batches, the last one partial."""
        return batches_per_epoch(shard_size(num_train, self.workers), self.batch_size)

    def samples_per_epoch(self, num_train: int) -> int:
        """Samples all workers together read per epoch (``num_train`` less the rotating rest)."""
        return shard_size(num_train, self.workers) * self.workers

    def total_samples(self, num_train: int) -> int:
        """Samples all workers together process in the whole run (whole epochs)."""
        return round(self.epochs * self.samples_per_epoch(num_train))
