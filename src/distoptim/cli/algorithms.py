"""The algorithms the command line compares: one registry entry each.

Owns: the name, table title and family of every algorithm, how its optimizer is built from the
library's public API around the torch optimizer every worker has, which options it uses, and
what it records. The training loop is the same for all (:mod:`distoptim.cli.training`)::

    opt.zero_grad(); loss = cross_entropy(model(x), y); loss.backward(); opt.step()

================  ===========================================================================
sync              ``CrossShardOptimizer(opt, reduction="mean")`` on N gloo ranks; global batch
                  N*B
localsgd          ``LocalSGD(opt, sync_every=H)``: parameter averaging every H steps
diloco            ``DiLoCo(opt, outer, sync_every=H, wire=...)``, ``outer`` Nesterov SGD
streaming-diloco  ``DiLoCo(opt, outer, sync_every=H, fragments=F, fragment_sync_delay=τ,
                  fragment_update_alpha=alpha, wire=...)``
agn               ``AGNOptimizer(opt, N, getter, communication_period=λ, update_rule=...)``
downpour          ``DownpourOptimizer(opt, N, getter, communication_period=λ)``
easgd             ``ElasticAverageOptimizer(opt, N, getter, communication_period=τ,
                  moving_rate=alpha)``
async-diloco      ``AsyncDiLoCoOptimizer(opt, N, getter, communication_period=H,
                  outer_optimizer=partial(SGD, ...), delayed_momentum=...,
                  dynamic_local_updates=...)``
================  ===========================================================================

The λ of the table and of ``--communication-period`` is the local steps between two
communications of a worker: AGN's λ, EASGD's τ, and LocalSGD's and DiLoCo's H.

Wire formats. DiLoCo and Streaming DiLoCo send their pseudo-gradients in a wire format of
:mod:`distoptim.comm.wire` (``fp32 fp16 bf16 int8 int4 int2 topk:D topk:D+V``): ``--wire``
sets it for every run of them, and an entry of ``--algos`` may carry its own,
``NAME@WIRE`` (``diloco@int4``, ``diloco@topk:0.02+int2``; :func:`split_entry`), so one grid
compares formats. A run whose wire is not its algorithm's default (``fp32`` for DiLoCo, ``int8``
for Streaming DiLoCo) is a variant of its own -- its own row, its own plot line or panel --
titled ``DiLoCo (int4)`` and labelled ``diloco@int4 λ=10 n=4``.

Families: ``collective`` algorithms run on one process group of N ranks (``build(opt, cfg)``);
``server`` algorithms on a parameter-server cluster of ``--num-ps`` shards and N workers
(``build(opt, cfg, cluster)``, ``cluster`` a :class:`distoptim.agn.Cluster`).

Adding an algorithm is one builder function and one :func:`register` call: say its family,
whether it sweeps over ``--communication-period``, and what settings it records.

Which parameters are *the model* of a run (evaluated during training and at the end):
``sync``'s parameters, which every rank shares; the DiLoCo family's global copy (what the
replicas agree on at each sync; a replica's local parameters drift between syncs); the
parameter server's center for the ``server`` family.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.cli.runconfig import AGN_RULES, MOVING_RATE_RULES, RunConfig

__all__ = [
    "ALGORITHMS",
    "FAMILIES",
    "Algorithm",
    "check",
    "get",
    "label",
    "title",
    "make_torch_optimizer",
    "processes_of",
    "register",
    "split_entry",
]

FAMILIES = ("collective", "server")


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of the command line.

    * ``build(opt, cfg, cluster)``: the distributed optimizer around ``opt`` (``cluster`` is
      None for the ``collective`` family).
    * ``periodic``: it communicates every ``communication_period`` local steps (λ/τ), so
      ``--communication-period`` sweeps it; others run with period 1.
    * ``variant(cfg)``: a setting the grid can sweep besides n and λ (AGN's rule), or "":
      runs with different variants are different cells of the table and panels of the plot.
    * ``detail(cfg)``: what the table shows after the title (e.g. EASGD's alpha), or "".
    * ``settings(cfg)``: the algorithm-specific settings ``results.json`` records, resolved.
    * ``note(cfg)``: a line under the table saying what the algorithm's settings mean, or "".
    * ``model(opt, model)``: the parameters that are the run's model (``collective`` family;
      default the model's own): what is evaluated during training and at the end.
    * ``check(cfg, model)``: raise ``ValueError`` if ``cfg`` cannot be built, before any
      process starts (``model`` is a freshly built model of the run), or None.
    * ``finish(opt)``: what every rank does after its last step, before the run's model is
      read (``collective`` family), or None: the DiLoCo family's ``finish()``, a last sync of
      what changed since the last periodic one, so the evaluated global model includes every
      inner step that was trained and counted.
    """

    name: str
    title: str
    family: str
    build: Callable[[torch.optim.Optimizer, RunConfig, Any], torch.optim.Optimizer]
    periodic: bool
    help: str
    variant: Callable[[RunConfig], str] = field(default=lambda cfg: "")
    detail: Callable[[RunConfig], str] = field(default=lambda cfg: "")
    settings: Callable[[RunConfig], dict[str, Any]] = field(default=lambda cfg: {})
    note: Callable[[RunConfig], str] = field(default=lambda cfg: "")
    model: Callable[[Any, torch.nn.Module], Sequence[torch.Tensor]] = field(
        default=lambda opt, model: list(model.parameters())
    )
    check: Callable[[RunConfig, torch.nn.Module], None] | None = None
    finish: Callable[[Any], None] | None = None
    default_wire: str | None = None
    """The wire format it sends when none is given (None: it takes no ``wire``)."""

    @property
    def communication_kind(self) -> str:
        """What the ``communications`` figure counts: a rank's all-reduces (sync), outer syncs
        (the DiLoCo family: ``opt.syncs``, one per fragment sync), or server commits."""
        if self.family == "server":
            return "commits"
        return "syncs" if self.model is _global_copy else "all-reduces"


ALGORITHMS: dict[str, Algorithm] = {}
"""Every algorithm by command-line name, in the order ``compare`` runs them."""


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to :data:`ALGORITHMS` (a new name, a known family)."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    if algorithm.family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {algorithm.family!r}")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Algorithm:
    """The algorithm called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r} (choose from {', '.join(ALGORITHMS)})"
        ) from None


def title(cfg: RunConfig) -> str:
    """The algorithm's name in the table and plots, with its variant: ``AGN (paper)``."""
    algo = get(cfg.algo)
    return f"{algo.title} ({algo.variant(cfg)})" if algo.variant(cfg) else algo.title


def label(cfg: RunConfig) -> str:
    """Short name of a run: ``sync n=4``, ``agn λ=10 n=4``, ``agn/tf λ=10 n=4 #2``,
    ``diloco@int4 λ=10 n=4`` (a wire that is not the algorithm's default)."""
    algo = get(cfg.algo)
    lam = f" λ={cfg.communication_period}" if algo.periodic else ""
    rule = "/tf" if cfg.algo == "agn" and cfg.agn_rule != "paper" else ""
    wire = f"@{_wire_variant(cfg)}" if _wire_variant(cfg) else ""
    rep = f" #{cfg.repeat + 1}" if cfg.repeat else ""
    return f"{cfg.algo}{rule}{wire}{lam} n={cfg.workers}{rep}"


def split_entry(text: str) -> tuple[str, str | None]:
    """An entry of ``--algos``: ``NAME`` or ``NAME@WIRE`` -> ``(name, canonical wire or
    None)``; ``ValueError`` naming what is wrong (an unknown name, a wire for an algorithm
    that sends none, a wire the registry does not know)."""
    from distoptim.comm.wire import parse_wire

    name, at, wire = text.partition("@")
    algo = get(name)
    if not at:
        return name, None
    if algo.default_wire is None:
        takes = ", ".join(a.name for a in ALGORITHMS.values() if a.default_wire is not None)
        raise ValueError(f"{name!r} sends no wire format; NAME@WIRE is for {takes}")
    return name, parse_wire(wire).name


def processes_of(cfg: RunConfig) -> int:
    """Processes a run needs: its workers, plus the shards of a ``server`` algorithm."""
    return cfg.workers + (cfg.num_ps if get(cfg.algo).family == "server" else 0)


def check(cfg: RunConfig, model: Callable[[], torch.nn.Module]) -> None:
    """``ValueError`` naming the run if ``cfg``'s algorithm cannot be built on ``model()``
    (called only for an algorithm that has a check)."""
    test = get(cfg.algo).check
    if test is None:
        return
    try:
        test(cfg, model())
    except ValueError as exc:
        raise ValueError(f"{label(cfg)}: {exc}") from None


def make_torch_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``sgd`` -> SGD; ``momentum`` -> SGD(momentum=0.9); ``adam`` -> Adam; ``adamw`` -> AdamW
    (torch's default weight decay 0.01, DiLoCo's inner optimizer)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"optimizer must be one of sgd, momentum, adam, adamw, got {name!r}")


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------
def _sync(opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any) -> torch.optim.Optimizer:
    import distoptim

    return distoptim.CrossShardOptimizer(opt, reduction="mean")


def _on_server(
    cls_name: str, opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any, **options: Any
) -> torch.optim.Optimizer:
    """``distoptim.<cls_name>(opt, N, getter, communication_period=λ, **options)``."""
    import distoptim

    cls = getattr(distoptim, cls_name)
    return cls(
        opt,
        cluster.num_worker,
        custom_getter=cluster.custom_getter,
        communication_period=cfg.communication_period,
        **options,
    )


def _wire(cfg: RunConfig) -> str:
    """The run's wire format: ``cfg.wire``, else its algorithm's default (DiLoCo's paper sends
    full precision; Streaming DiLoCo's point is to send fragments in low precision: int8 here,
    with error feedback)."""
    return cfg.wire or get(cfg.algo).default_wire or "fp32"


def _wire_variant(cfg: RunConfig) -> str:
    """The run's wire when it is not its algorithm's default (a variant of its own), or ""."""
    default = get(cfg.algo).default_wire
    return "" if default is None or _wire(cfg) == default else _wire(cfg)


def _outer_factory(cfg: RunConfig) -> Callable[..., torch.optim.Optimizer]:
    """DiLoCo's outer optimizer as a picklable factory ``f(params)``: SGD at ``--outer-lr`` with
    Nesterov momentum ``--outer-momentum`` (plain SGD at momentum 0)."""
    mu = cfg.outer_momentum
    return functools.partial(torch.optim.SGD, lr=cfg.outer_lr, momentum=mu, nesterov=mu > 0)


def _outer_optimizer(opt: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.Optimizer:
    """The outer optimizer over ``opt``'s parameters (the DiLoCo family's global copy)."""
    return _outer_factory(cfg)([p for g in opt.param_groups for p in g["params"]])


def _outer_spec(cfg: RunConfig) -> dict[str, Any]:
    """What ``results.json`` records of the outer optimizer."""
    mu = cfg.outer_momentum
    return {"optimizer": "SGD", "lr": cfg.outer_lr, "momentum": mu, "nesterov": mu > 0}


def _localsgd(opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any) -> torch.optim.Optimizer:
    import distoptim

    return distoptim.LocalSGD(opt, sync_every=cfg.communication_period)


def _diloco(opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any) -> torch.optim.Optimizer:
    import distoptim

    outer = _outer_optimizer(opt, cfg)
    return distoptim.DiLoCo(opt, outer, sync_every=cfg.communication_period, wire=_wire(cfg))


def _streaming(opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any) -> torch.optim.Optimizer:
    import distoptim

    return distoptim.DiLoCo(
        opt,
        _outer_optimizer(opt, cfg),
        sync_every=cfg.communication_period,
        fragments=cfg.fragments,
        fragment_sync_delay=cfg.fragment_sync_delay,
        fragment_update_alpha=cfg.fragment_alpha,
        wire=_wire(cfg),
        name="StreamingDiLoCo",
    )


def _built_alone(build: Callable[..., torch.optim.Optimizer]) -> Callable[..., None]:
    """A check that builds the optimizer on ``model`` in this process (no process group: one
    replica, nothing sent), so the library's own validation speaks before any process starts."""

    def check(cfg: RunConfig, model: torch.nn.Module) -> None:
        build(make_torch_optimizer(cfg.optimizer, model.parameters(), cfg.lr), cfg, None)

    return check


def _global_copy(opt: Any, model: torch.nn.Module) -> Sequence[torch.Tensor]:
    return opt.global_parameters


def _finish(opt: Any) -> None:
    """The DiLoCo family's end of training: ``opt.finish()`` on every rank (a collective)."""
    opt.finish()


def _outer_settings(cfg: RunConfig) -> dict[str, Any]:
    return {"sync_every": cfg.communication_period, "outer": _outer_spec(cfg), "wire": _wire(cfg)}


def _outer_note(cfg: RunConfig) -> str:
    mu = cfg.outer_momentum
    kind = f"Nesterov momentum {mu:g}" if mu > 0 else "no momentum"
    return (
        f"DiLoCo: every H = λ steps the replicas average θ_global - θ_local and an outer SGD "
        f"(lr {cfg.outer_lr:g}, {kind}) steps the global copy; inner: --optimizer"
    )


_AGN_NOTES = {
    "paper": "AGN (paper): Hermans et al.'s rule, commit (θ-θ_pulled)/λ, the server adds it",
    "tf": "AGN (tf): TF contrib's rule, commit a/λ, the server runs its own optimizer on it",
}


def _async_diloco(
    opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any
) -> torch.optim.Optimizer:
    import distoptim

    return distoptim.AsyncDiLoCoOptimizer(
        opt,
        cfg.workers,
        custom_getter=None if cluster is None else cluster.custom_getter,
        communication_period=cfg.communication_period,
        outer_optimizer=_outer_factory(cfg),  # pickled to the shard, which builds it there
        delayed_momentum=cfg.delayed_nesterov,
        dynamic_local_updates=cfg.dylu,
    )


def _async_detail(cfg: RunConfig) -> str:
    parts = [f"DN={cfg.delayed_nesterov}"] if cfg.delayed_nesterov else []
    return " ".join(parts + (["DyLU"] if cfg.dylu else []))


def _async_note(cfg: RunConfig) -> str:
    mu = cfg.outer_momentum
    outer = f"SGD lr {cfg.outer_lr:g}" + (f", Nesterov momentum {mu:g}" if mu > 0 else "")
    return (
        "Async DiLoCo: each worker commits θ_pulled - θ_local every H = λ of its steps; the "
        f"server's outer {outer} applies it on arrival; DN=N: Delayed Nesterov (momentum "
        "applied every N commits), DyLU: H scaled by each worker's measured speed"
    )


def _agn(opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any) -> torch.optim.Optimizer:
    return _on_server("AGNOptimizer", opt, cfg, cluster, update_rule=AGN_RULES[cfg.agn_rule])


def _downpour(opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any) -> torch.optim.Optimizer:
    return _on_server("DownpourOptimizer", opt, cfg, cluster)


def _easgd(opt: torch.optim.Optimizer, cfg: RunConfig, cluster: Any) -> torch.optim.Optimizer:
    return _on_server("ElasticAverageOptimizer", opt, cfg, cluster, moving_rate=cfg.easgd_alpha)


register(
    Algorithm(
        "sync",
        "sync",
        "collective",
        _sync,
        periodic=False,
        help="CrossShardOptimizer: gradients averaged over all workers every step",
    )
)
register(
    Algorithm(
        "localsgd",
        "LocalSGD",
        "collective",
        _localsgd,
        periodic=True,
        help="LocalSGD: parameters averaged over all workers every H = λ steps",
        settings=lambda cfg: {"sync_every": cfg.communication_period},
        model=_global_copy,
        check=_built_alone(_localsgd),
        finish=_finish,
    )
)
register(
    Algorithm(
        "diloco",
        "DiLoCo",
        "collective",
        _diloco,
        periodic=True,
        help="DiLoCo: outer Nesterov SGD on the averaged pseudo-gradient every H = λ steps",
        variant=_wire_variant,
        settings=_outer_settings,
        note=_outer_note,
        model=_global_copy,
        check=_built_alone(_diloco),
        finish=_finish,
        default_wire="fp32",
    )
)
register(
    Algorithm(
        "streaming-diloco",
        "Streaming DiLoCo",
        "collective",
        _streaming,
        periodic=True,
        help="Streaming DiLoCo: --fragments sync in turn, overlapped, in the --wire format",
        variant=_wire_variant,
        detail=lambda cfg: f"F={cfg.fragments}" + ("" if _wire_variant(cfg) else f" {_wire(cfg)}"),
        settings=lambda cfg: {
            **_outer_settings(cfg),
            "fragments": cfg.fragments,
            "fragment_sync_delay": cfg.fragment_sync_delay,
            "fragment_update_alpha": cfg.fragment_alpha,
        },
        note=lambda cfg: (
            f"Streaming DiLoCo F={cfg.fragments}: the model in {cfg.fragments} fragments, one "
            f"syncing every H/{cfg.fragments} steps, "
            f"its outer step applied τ = {cfg.fragment_sync_delay} step(s) later, local values "
            f"mixed with \N{GREEK SMALL LETTER ALPHA} = {cfg.fragment_alpha:g}; int8 etc.: the "
            "wire format"
        ),
        model=_global_copy,
        check=_built_alone(_streaming),
        finish=_finish,
        default_wire="int8",
    )
)
register(
    Algorithm(
        "agn",
        "AGN",
        "server",
        _agn,
        periodic=True,
        help="Accumulated Gradient Normalization on a parameter server (--agn-rule)",
        variant=lambda cfg: cfg.agn_rule,
        settings=lambda cfg: {
            "agn_rule": cfg.agn_rule,
            "update_rule": AGN_RULES[cfg.agn_rule],
            "communication_period": cfg.communication_period,
            "transport": cfg.transport,
        },
        note=lambda cfg: _AGN_NOTES[cfg.agn_rule],
    )
)
register(
    Algorithm(
        "downpour",
        "DOWNPOUR",
        "server",
        _downpour,
        periodic=True,
        help="DOWNPOUR: accumulated updates committed every λ steps, not normalized",
        settings=lambda cfg: {
            "communication_period": cfg.communication_period,
            "transport": cfg.transport,
        },
    )
)
register(
    Algorithm(
        "easgd",
        "EASGD",
        "server",
        _easgd,
        periodic=True,
        help="asynchronous Elastic Averaging SGD every τ steps (--moving-rate)",
        detail=lambda cfg: f"\N{GREEK SMALL LETTER ALPHA}={cfg.easgd_alpha:.3g}",
        settings=lambda cfg: {
            "moving_rate": cfg.easgd_alpha,
            "moving_rate_rule": MOVING_RATE_RULES.get(cfg.moving_rate, "fixed"),
            "communication_period": cfg.communication_period,
            "transport": cfg.transport,
        },
        note=lambda cfg: (
            "EASGD \N{GREEK SMALL LETTER ALPHA}: the elastic pull's moving rate (--moving-rate)"
        ),
    )
)
register(
    Algorithm(
        "async-diloco",
        "Async DiLoCo",
        "server",
        _async_diloco,
        periodic=True,
        help="asynchronous DiLoCo on the parameter server (--delayed-momentum, --dylu)",
        detail=_async_detail,
        settings=lambda cfg: {
            "communication_period": cfg.communication_period,
            "outer": _outer_spec(cfg),
            "delayed_momentum": cfg.delayed_nesterov,
            "dynamic_local_updates": cfg.dylu,
            "transport": cfg.transport,
        },
        note=_async_note,
        check=_built_alone(_async_diloco),
    )
)
