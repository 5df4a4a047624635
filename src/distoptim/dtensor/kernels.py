"""The update kernels of the mesh-aware SGD and their dispatcher (torch's SGD form).

Owns: one update rule, written four ways with one signature, on lists of plain tensors that
share device and dtype (the local shards of one bucket), and the choice between them:

* :func:`_single` -- per tensor, in-place torch ops (the reference; ``SGD.update_step``);
* :func:`_foreach` -- ``torch._foreach_*`` over the list (any device, any strides);
* :func:`_fused` -- torch's fused SGD kernel, one pass over memory (see :func:`fused_sgd_step`);
* :class:`CompiledUpdate` -- the same body through ``torch.compile`` (``jit_compile=True``).

The rule, with the hyperparameters of :class:`KernelParams` (``momentum`` μ, ``dampening`` d,
``lr`` L, ``nesterov``) -- torch's SGD without weight decay::

    no buffer:  w -= L * g
    else:       b  = μ * b + (1 - d) * g
                w -= L * (g + μ * b)        (nesterov)
                w -= L * b                  (otherwise)

Gradients are only read. How Keras' update maps onto it exactly (the momentum kept in torch's
buffer units, whatever the learning rate does) is :mod:`distoptim.dtensor.momentum`'s job.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "CompiledUpdate",
    "KernelParams",
    "fused_sgd_step",
    "fused_supported",
    "sgd_update",
    "strided_positions",
]


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """The hyperparameters of one kernel call (see the module docstring for the rule)."""

    momentum: float
    dampening: float
    lr: float
    nesterov: bool


# ---- the one private torch API ---------------------------------------------------------------
# torch's fused SGD kernel, trusted only where tests/dtensor/test_kernels.py pins its behaviour:
# CUDA in every float dtype; CPU in float32/float64 (in torch 2.13 the CPU kernel's vectorized
# loop reads bfloat16/float16 momentum buffers as float32 and gives wrong results, so those
# dtypes take the foreach path on CPU).
_FUSED_DTYPES = {
    "cpu": (torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
}


def fused_sgd_step(
    ws: list[torch.Tensor], gs: list[torch.Tensor], bufs: list[torch.Tensor] | None, p: KernelParams
) -> None:
    """``torch._fused_sgd_`` on contiguous, same-device, same-dtype lists: the rule in one pass.

    Without ``grad_scale`` the kernel only reads the gradients (with it, it would write the
    unscaled gradient back into them: we never pass one). It walks raw memory, so every tensor
    must be contiguous (it does not check: a transposed gradient would be read in the wrong
    order). With ``bufs`` None the momentum must be 0 (no buffer list); with buffers it must be
    > 0 (the CUDA kernel refuses 0).
    """
    torch._fused_sgd_(
        ws,
        gs,
        [] if bufs is None else bufs,
        weight_decay=0.0,
        momentum=0.0 if bufs is None else p.momentum,
        lr=p.lr,
        dampening=p.dampening,
        nesterov=p.nesterov,
        maximize=False,
        is_first_step=False,
    )


def fused_supported(t: torch.Tensor) -> bool:
    """Whether :func:`fused_sgd_step` is trusted for ``t``'s device and dtype."""
    return t.dtype in _FUSED_DTYPES.get(t.device.type, ())


# ---- the four implementations ----------------------------------------------------------------
def _single(
    ws: list[torch.Tensor], gs: list[torch.Tensor], bufs: list[torch.Tensor] | None, p: KernelParams
) -> None:
    for i, (w, g) in enumerate(zip(ws, gs)):
        if bufs is None:
            w.add_(g, alpha=-p.lr)
            continue
        b = bufs[i]
        b.mul_(p.momentum).add_(g, alpha=1.0 - p.dampening)
        if p.nesterov:
            w.add_(g, alpha=-p.lr).add_(b, alpha=-p.lr * p.momentum)
        else:
            w.add_(b, alpha=-p.lr)


def _foreach(
    ws: list[torch.Tensor], gs: list[torch.Tensor], bufs: list[torch.Tensor] | None, p: KernelParams
) -> None:
    if bufs is None:
        torch._foreach_add_(ws, gs, alpha=-p.lr)
        return
    torch._foreach_mul_(bufs, p.momentum)
    torch._foreach_add_(bufs, gs, alpha=1.0 - p.dampening)
    if p.nesterov:
        torch._foreach_add_(ws, gs, alpha=-p.lr)
        torch._foreach_add_(ws, bufs, alpha=-p.lr * p.momentum)
    else:
        torch._foreach_add_(ws, bufs, alpha=-p.lr)


def _fused(
    ws: list[torch.Tensor], gs: list[torch.Tensor], bufs: list[torch.Tensor] | None, p: KernelParams
) -> None:
    fused_sgd_step(ws, gs, bufs, p)


def _jit_body(
    ws: list[torch.Tensor],
    gs: list[torch.Tensor],
    bufs: list[torch.Tensor],
    momentum: torch.Tensor,
    grad_coef: torch.Tensor,
    lr: torch.Tensor,
    nesterov: bool,
) -> None:
    """The rule for ``torch.compile``, which fuses it per tensor (read w, g, b; write w, b).

    The scalars are 0-dim tensors so that a changing learning rate does not recompile;
    ``grad_coef`` is ``1 - dampening``. Foreach ops keep the traced graph small.
    """
    if not bufs:
        torch._foreach_sub_(ws, torch._foreach_mul(gs, lr))
        return
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, torch._foreach_mul(gs, grad_coef))
    step = torch._foreach_add(gs, torch._foreach_mul(bufs, momentum)) if nesterov else bufs
    torch._foreach_sub_(ws, torch._foreach_mul(step, lr))


class CompiledUpdate:
    """The rule through ``torch.compile`` (compiled on first use, kept for the optimizer's life).

    :meth:`__call__` returns False -- having changed nothing -- if compilation is unavailable
    or fails (warning once); the caller then runs the eager dispatcher.
    """

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None
        self.failed = not _dynamo_supported()
        self._scalars: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def __call__(
        self,
        ws: list[torch.Tensor],
        gs: list[torch.Tensor],
        bufs: list[torch.Tensor] | None,
        p: KernelParams,
    ) -> bool:
        if self.failed:
            return False
        if self._fn is None:
            self._fn = torch.compile(_jit_body, dynamic=False, fullgraph=True)
        key = (ws[0].device, ws[0].dtype)
        scalars = self._scalars.get(key)
        if scalars is None:
            dtype = torch.float64 if ws[0].dtype == torch.float64 else torch.float32
            scalars = self._scalars[key] = [
                torch.empty((), dtype=dtype, device=key[0]) for _ in range(3)
            ]
        for t, value in zip(scalars, (p.momentum, 1.0 - p.dampening, p.lr)):
            t.fill_(value)
        try:
            self._fn(ws, gs, bufs or [], *scalars, p.nesterov)
        except Exception as exc:  # compilation runs before any kernel: nothing was changed
            self.failed = True
            warnings.warn(
                f"jit_compile: torch.compile failed ({type(exc).__name__}: {exc}); "
                "SGD falls back to the eager update",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        return True


def _dynamo_supported() -> bool:
    try:
        import torch._dynamo

        return bool(torch._dynamo.is_dynamo_supported())
    except Exception:
        return False


_IMPLS = {"single": _single, "foreach": _foreach, "fused": _fused}


def strided_positions(*lists: Sequence[torch.Tensor] | None) -> list[int]:
    """The positions ``i``, ascending, at which some list's tensor is not contiguous (``None``
    lists are skipped; the others are equally long): the tensors the fused kernel must not see.
    """
    odd: set[int] = set()
    for ts in lists:
        if ts is not None:
            odd.update(i for i, t in enumerate(ts) if not t.is_contiguous())
    return sorted(odd)


def sgd_update(
    ws: list[torch.Tensor],
    gs: list[torch.Tensor],
    bufs: list[torch.Tensor] | None,
    p: KernelParams,
    impl: str = "auto",
    strided: Sequence[int] | None = None,
) -> None:
    """The rule in place on ``ws`` (and ``bufs``), reading ``gs``; all on one device and dtype.

    ``impl="auto"``: the fused kernel for every triple of contiguous tensors where it is
    trusted (:func:`fused_supported`), ``torch._foreach_*`` for the rest (other devices,
    strided tensors). ``"single"``, ``"foreach"``, ``"fused"`` force one implementation.
    ``strided``: :func:`strided_positions` ``(ws, gs, bufs)`` when the caller knows it (it must
    be exact: the fused kernel would read a strided tensor in the wrong order); ``None``: it is
    computed here.
    """
    if impl != "auto":
        _IMPLS[impl](ws, gs, bufs, p)
        return
    if not ws:
        return
    if not fused_supported(ws[0]):
        _foreach(ws, gs, bufs, p)
        return
    odd = strided_positions(ws, gs, bufs) if strided is None else strided
    if not odd:
        _fused(ws, gs, bufs, p)
        return
    skip = set(odd)
    keep = [i for i in range(len(ws)) if i not in skip]
    for idx, fn in ((keep, _fused), (odd, _foreach)):
        if idx:
            fn(
                [ws[i] for i in idx],
                [gs[i] for i in idx],
                None if bufs is None else [bufs[i] for i in idx],
                p,
            )
