"""Single-process references for the outer-optimizer family, built from plain torch optimizers.

One local model copy and inner optimizer per replica, one global model copy and outer
optimizer; each sync follows the algorithm as the papers write it (no distoptim code except
the fragment partition, which ``test_fragments.py`` checks on its own). A lossy wire averages
each fragment's pseudo-gradients, flattened in parameter order (one bucket), with the wire
formats' own reference (:class:`tests.comm.reference.Mean`, residuals per fragment). Shared by
the single-process and the multi-rank tests (spawned children import this module).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distoptim.outer.fragments import partition
from tests.comm.reference import Mean

STEPS_MAX = 128
BATCH = 4


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def data(replicas: int, steps: int = STEPS_MAX, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[r, t]``, ``y[r, t]``: replica ``r``'s batch at inner step ``t`` (0-based)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(replicas, steps, BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randn(replicas, steps, BATCH, 3, generator=g, dtype=torch.float64)
    return x, y


def flat(params: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


# factories by name, so configurations pickle into spawned children
INNER: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
}
OUTER: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
}


@dataclass(frozen=True)
class Config:
    """One DiLoCo configuration and run length (``outer=None``: LocalSGD)."""

    inner: str = "sgd"
    outer: str | None = "nesterov"
    sync_every: int = 3
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    steps: int = 9
    wire: str = "fp32"
    error_feedback: bool = True

    def kwargs(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "fragments": self.fragments,
            "fragment_sync_delay": self.delay,
            "fragment_update_alpha": self.alpha,
            "wire": self.wire,
            "error_feedback": self.error_feedback,
        }


def build(cfg: Config, model: nn.Module, **extra: Any) -> torch.optim.Optimizer:
    """The distoptim optimizer of ``cfg`` over ``model``."""
    import distoptim

    inner = INNER[cfg.inner](model.parameters())
    if cfg.outer is None:
        return distoptim.LocalSGD(inner, sync_every=cfg.sync_every, **extra)
    outer = OUTER[cfg.outer](model.parameters())
    return distoptim.DiLoCo(inner, outer, **cfg.kwargs(), **extra)


def run(
    cfg: Config,
    rank: int,
    world: int,
    start: int = 0,
    stop: int | None = None,
    model: nn.Module | None = None,
    opt: torch.optim.Optimizer | None = None,
    **extra: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Steps ``start .. stop - 1`` of rank ``rank`` (of ``world``) with the distoptim optimizer."""
    x, y = data(world)
    if model is None:
        model = mlp()
    if opt is None:
        opt = build(cfg, model, **extra)
    for t in range(start, cfg.steps if stop is None else stop):
        opt.zero_grad()
        loss_of(model, x[rank, t], y[rank, t]).backward()
        opt.step()
    return model, opt


def simulate(
    cfg: Config, world: int, ranks: list[int] | None = None, finish: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The reference: ``(final local parameters of each replica, final global copy)``, flat.

    The replicas are ``ranks`` (default: all ``world``), each reading its rank's data. With
    ``finish`` the run ends as ``finish()`` ends it: the sync in flight is applied now, then
    every fragment whose local values are not its global copy (no sync applied at the last
    step with ``alpha = 0``) syncs once more, its local values set to the new global values.
    """
    x, y = data(world)
    ranks = list(range(world)) if ranks is None else ranks
    x, y = x[ranks], y[ranks]
    replicas = len(ranks)
    base = mlp()
    models = [copy.deepcopy(base) for _ in range(replicas)]
    inners = [INNER[cfg.inner](m.parameters()) for m in models]
    global_model = copy.deepcopy(base)
    gparams = list(global_model.parameters())
    outer = None if cfg.outer is None else OUTER[cfg.outer](gparams)
    sizes = [p.numel() * p.element_size() for p in gparams]
    frags = partition(sizes, cfg.fragments)
    period = cfg.sync_every // cfg.fragments
    pending: tuple[int, int, list[torch.Tensor]] | None = None
    lossy = cfg.outer is not None and cfg.wire.lower() != "fp32" and replicas > 1
    wires = [Mean(cfg.wire, replicas, cfg.error_feedback) for _ in frags] if lossy else []

    synced_at = [0] * len(frags)  # the step at which each fragment's local values were global

    def apply(p: int, mean: list[torch.Tensor], t: int, alpha: float = cfg.alpha) -> None:
        lo, hi = frags[p]
        if alpha == 0:
            synced_at[p] = t
        if outer is None:  # LocalSGD: the average of the replicas
            for i in range(lo, hi):
                avg = torch.stack([list(m.parameters())[i].detach() for m in models]).mean(0)
                with torch.no_grad():
                    gparams[i].copy_(avg)
        else:
            for i, gp in enumerate(gparams):
                gp.grad = mean[i - lo] if lo <= i < hi else None
            outer.step()
        for m in models:
            ps = list(m.parameters())
            with torch.no_grad():
                for i in range(lo, hi):
                    ps[i].copy_(alpha * ps[i] + (1 - alpha) * gparams[i])

    def pseudo_gradient_mean(p: int) -> list[torch.Tensor]:
        lo, hi = frags[p]
        deltas = [
            [gparams[i].detach() - list(m.parameters())[i].detach() for m in models]
            for i in range(lo, hi)
        ]
        if not lossy:
            return [torch.stack(d).mean(0) for d in deltas]
        # the fragment flattened, as its one bucket travels
        flat_mean = wires[p]([flat(d[r] for d in deltas) for r in range(replicas)])
        sizes = [gparams[i].numel() for i in range(lo, hi)]
        return [v.view_as(gparams[i]) for i, v in zip(range(lo, hi), flat_mean.split(sizes))]

    for t in range(1, cfg.steps + 1):
        for r, (m, inner) in enumerate(zip(models, inners)):
            inner.zero_grad()
            loss_of(m, x[r, t - 1], y[r, t - 1]).backward()
            inner.step()
        if pending is not None and pending[1] + cfg.delay == t:
            apply(pending[0], pending[2], t)
            pending = None
        if t % period == 0:
            p = (t // period - 1) % cfg.fragments
            pending = (p, t, pseudo_gradient_mean(p))
            if cfg.delay == 0:
                apply(p, pending[2], t)
                pending = None
    if finish:
        if pending is not None:
            apply(pending[0], pending[2], cfg.steps)
        for p in range(len(frags)):
            if synced_at[p] != cfg.steps:
                apply(p, pseudo_gradient_mean(p), cfg.steps, alpha=0.0)
    return [flat(m.parameters()) for m in models], flat(gparams)
