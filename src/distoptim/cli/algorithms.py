"""The algorithms the command line compares: one registry entry each.

Owns: the name, table title and family of every algorithm, how its optimizer is built from the
library's public API around the torch optimizer every worker has, which options it uses, and
what it records. The training loop is the same for all (:mod:`distoptim.cli.worker`)::

    opt.zero_grad(); loss = cross_entropy(model(x), y); loss.backward(); opt.step()

=========  ==================================================================================
sync       ``CrossShardOptimizer(opt, reduction="mean")`` on N gloo ranks; global batch N*B
agn        ``AGNOptimizer(opt, N, getter, communication_period=λ, update_rule=...)``
downpour   ``DownpourOptimizer(opt, N, getter, communication_period=λ)``
easgd      ``ElasticAverageOptimizer(opt, N, getter, communication_period=τ, moving_rate=alpha)``
=========  ==================================================================================

Families: ``collective`` algorithms run on one process group of N ranks (``build(opt, cfg)``);
``server`` algorithms on a parameter-server cluster of ``--num-ps`` shards and N workers
(``build(opt, cfg, cluster)``, ``cluster`` a :class:`distoptim.agn.Cluster`).

Adding an algorithm is one builder function and one :func:`register` call: say its family,
whether it sweeps over ``--communication-period``, and what settings it records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.cli.config import AGN_RULES, MOVING_RATE_RULES, RunConfig

__all__ = [
    "ALGORITHMS",
    "FAMILIES",
    "Algorithm",
    "get",
    "label",
    "title",
    "make_torch_optimizer",
    "processes_of",
    "register",
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

    @property
    def communication_kind(self) -> str:
        """What the ``communications`` figure counts: all-reduces per rank, or server commits."""
        return "all-reduces" if self.family == "collective" else "commits"


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
    """Short name of a run: ``sync n=4``, ``agn λ=10 n=4``, ``agn/tf λ=10 n=4 #2``."""
    algo = get(cfg.algo)
    lam = f" λ={cfg.communication_period}" if algo.periodic else ""
    rule = "/tf" if cfg.algo == "agn" and cfg.agn_rule != "paper" else ""
    rep = f" #{cfg.repeat + 1}" if cfg.repeat else ""
    return f"{cfg.algo}{rule}{lam} n={cfg.workers}{rep}"


def processes_of(cfg: RunConfig) -> int:
    """Processes a run needs: its workers, plus the shards of a ``server`` algorithm."""
    return cfg.workers + (cfg.num_ps if get(cfg.algo).family == "server" else 0)


def make_torch_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``sgd`` -> SGD; ``momentum`` -> SGD(momentum=0.9); ``adam`` -> Adam."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be one of sgd, momentum, adam, got {name!r}")


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
        },
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
        settings=lambda cfg: {"communication_period": cfg.communication_period},
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
        },
    )
)
