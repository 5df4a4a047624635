"""A table's server optimizer, stepped chunk by chunk when its update is element-wise.

Owns :class:`ServerOptimizer`: the ``torch.optim.Optimizer`` a shard's
:class:`~distoptim.agn.rules.ApplyOptimizer` rule steps for one table (a new instance of the
worker's wrapped optimizer class with its hyperparameters, or AsyncDiLoCo's outer optimizer),
built over views of the table's center, and how its state is kept and checkpointed.

Chunk by chunk
--------------
A commit is applied chunk by chunk (:mod:`distoptim.agn.flat`), while the rest of it is still
arriving. That is exact for an *element-wise* optimizer -- one whose new value of each element
depends only on that element's parameter, gradient and state, plus per-tensor scalars that
depend on the step count and hyperparameters alone
(:func:`~distoptim.elementwise_rule.is_elementwise`: SGD, Adam, AdamW, Adagrad, ...,
and classes marked ``@elementwise``, e.g. :class:`~distoptim.agn.rules.DelayedNesterov`). Such an
optimizer is built over the **pieces** of the table's chunk plan (1-D views of the center, one
per variable and chunk, :class:`~distoptim.agn.flat.Piece`), in variable order, grouped as the
worker's param groups. :meth:`ServerOptimizer.only` redirects its param groups to one chunk's
pieces for the duration of a ``step()`` (the optimizer is redirected, not rebuilt: its
hyperparameters, hooks and subclass code work unchanged). Each piece keeps its own state
(per-element tensors of the piece's length, scalars such as Adam's ``step`` per piece) and every
piece is stepped exactly once per commit, so its step counter advances once per commit and
every element follows exactly the trajectory of the same optimizer over whole variables.

Any other optimizer (LBFGS, Adafactor's factored moments, a global-norm clip inside ``step``,
an unknown subclass) is built over the variables, as on the worker, and stepped **whole**, once
every chunk of a commit has arrived (``chunkwise`` is False).

State
-----
:meth:`ServerOptimizer.state_dict` and :meth:`~ServerOptimizer.load_state_dict` always use the
*per-variable* form -- what the same optimizer built over the variables would save: each
variable's per-element state is its pieces' state concatenated and reshaped, its scalars are its
first piece's. Checkpoints therefore do not depend on the chunk size, and a checkpoint written
before chunking existed loads unchanged.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from distoptim.agn.flat import Chunk
from distoptim.agn.transport.messages import TableSpec
from distoptim.elementwise_rule import is_elementwise, is_per_element

__all__ = ["ServerOptimizer", "build_optimizer"]

# per-tensor scalar state of torch's element-wise optimizers: for a 0-dim variable a per-element
# value and a scalar have the same shape, so the key tells them apart


def build_optimizer(
    spec: TableSpec, params: Sequence[Sequence[torch.Tensor]]
) -> torch.optim.Optimizer:
    """A fresh ``spec.optimizer_cls`` over ``params[g]`` for each of ``spec.groups`` (with the
    worker's hyperparameters of that group)."""
    assert spec.optimizer_cls is not None
    groups = [{**hp, "params": list(ps)} for (_, hp, _), ps in zip(spec.groups, params)]
    try:
        accepted = inspect.signature(spec.optimizer_cls.__init__).parameters
    except (TypeError, ValueError):
        accepted = {}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in spec.defaults.items() if takes_kwargs or k in accepted}
    try:
        return spec.optimizer_cls(groups, **kwargs)
    except Exception as exc:
        raise TypeError(
            f"the parameter server could not build the server optimizer "
            f"{getattr(spec.optimizer_cls, '__name__', repr(spec.optimizer_cls))}"
            f"(param_groups, **{sorted(kwargs)}): {exc}. AGN's "
            "gradient rule needs an optimizer class constructible from (params, **defaults); "
            "use update_rule='delta' otherwise"
        ) from exc


class ServerOptimizer:
    """The server optimizer of one table (see the module docstring).

    ``variables``: the per-variable views of the center; ``chunks``: the table's chunk plan;
    ``flats``: the center buffers; ``pieces``: whether the rule may be applied chunk by chunk
    (else the optimizer is built over the variables whatever it is). Attributes: ``optimizer``
    (the torch optimizer), ``chunkwise``
    (built over pieces, steppable chunk by chunk), ``params`` (what it is built over: pieces or
    variables, in its own order), ``chunk_params[k]`` (chunk ``k``'s pieces, in chunk order;
    empty lists when not chunkwise).
    """

    def __init__(
        self,
        spec: TableSpec,
        variables: list[torch.Tensor],
        chunks: list[Chunk],
        flats: dict[str, torch.Tensor],
        pieces: bool = True,
    ) -> None:
        group_vars = [list(pos) for _, _, pos in spec.groups]
        self._worker_groups = [g for g, _, _ in spec.groups]
        probe = build_optimizer(spec, [[variables[i] for i in pos] for pos in group_vars])
        self.chunkwise = pieces and is_elementwise(probe)
        self._group_vars = group_vars
        self._shapes = [v.shape for v in variables]
        if not self.chunkwise:
            self.optimizer = probe
            self.params = [variables[i] for pos in group_vars for i in pos]
            self.chunk_params: list[list[torch.Tensor]] = [[] for _ in chunks]
            self._pieces_of: list[list[int]] = [[j] for j in range(len(self.params))]
            self._numel: list[int] = [p.numel() for p in self.params]
            return
        per_var: list[list[tuple[int, torch.Tensor]]] = [[] for _ in variables]
        for chunk in chunks:
            for piece, view in zip(chunk.pieces, chunk.piece_views(flats)):
                per_var[piece.var].append((chunk.index, view))
        self.params = []
        self._pieces_of = [[] for _ in variables]  # variable -> its pieces' indices in params
        at: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, variable) -> its piece
        self._chunk_groups: list[list[list[torch.Tensor]]] = [
            [[] for _ in group_vars] for _ in chunks
        ]
        for g, pos in enumerate(group_vars):
            for i in pos:
                for k, view in per_var[i]:
                    self._pieces_of[i].append(len(self.params))
                    self.params.append(view)
                    self._chunk_groups[k][g].append(view)
                    at[k, i] = view
        self._numel = [p.numel() for p in self.params]
        self.chunk_params = [[at[c.index, piece.var] for piece in c.pieces] for c in chunks]
        self.optimizer = build_optimizer(
            spec, [[view for i in pos for _, view in per_var[i]] for pos in group_vars]
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def follow(self, hparams: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """Follow the workers' hyperparameters (LR schedules): each param group takes the numeric,
        non-NaN values ``hparams`` holds for its worker param group; returns every group's
        previous values, for :meth:`restore_hyperparameters` (a refused commit's hyperparameters
        do not stick)."""
        groups = self.optimizer.param_groups
        kept = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        for group, worker_group in zip(groups, self._worker_groups):
            hp = hparams.get(worker_group)
            if hp:
                for k, v in hp.items():
                    if (
                        k != "params"
                        and isinstance(v, (int, float))
                        and not (isinstance(v, float) and math.isnan(v))
                    ):
                        group[k] = v
        return kept

    def restore_hyperparameters(self, kept: list[dict[str, Any]]) -> None:
        """Put back the values :meth:`follow` returned."""
        for group, old in zip(self.optimizer.param_groups, kept):
            group.update(old)

    @contextlib.contextmanager
    def only(self, chunk: int) -> Iterator[list[torch.Tensor]]:
        """Within: the optimizer's param groups list chunk ``chunk``'s pieces only; yields them
        (in chunk order). Chunkwise optimizers only."""
        if not self.chunkwise:
            raise RuntimeError("this server optimizer is stepped whole (not element-wise)")
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, self._chunk_groups[chunk]):
                g["params"] = params
            yield self.chunk_params[chunk]
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    # ---- state, in the per-variable form ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` as an optimizer over the variables would give it."""
        sd = self.optimizer.state_dict()
        if not self.chunkwise:
            return sd
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for pos, group in zip(self._group_vars, sd["param_groups"]):
            ids = []
            for i in pos:
                parts = [sd["state"].get(j) for j in self._pieces_of[i]]
                if parts and all(parts):
                    state[index] = self._join(parts, self._pieces_of[i], self._shapes[i])
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def _join(self, parts: list[dict[str, Any]], pieces: list[int], shape: torch.Size) -> dict:
        out: dict[str, Any] = {}
        for key, first in parts[0].items():
            if (
                isinstance(first, torch.Tensor)
                and first.dim() == 1
                and first.numel() == (self._numel[pieces[0]])
            ):
                out[key] = torch.cat([p[key] for p in parts]).view(shape)
            else:
                out[key] = first.clone() if isinstance(first, torch.Tensor) else first
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a per-variable ``state_dict`` (see :meth:`state_dict`)."""
        if not self.chunkwise:
            self.optimizer.load_state_dict(sd)
            return
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for pos, group in zip(self._group_vars, sd["param_groups"]):
            ids = []
            for i, vid in zip(pos, group["params"]):
                saved = sd["state"].get(vid)
                start = 0
                for j in self._pieces_of[i]:
                    n = self._numel[j]
                    if saved:
                        state[j] = self._slice(saved, self._shapes[i], start, start + n)
                    start += n
                ids.extend(self._pieces_of[i])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    @staticmethod
    def _slice(saved: dict[str, Any], shape: torch.Size, lo: int, hi: int) -> dict[str, Any]:
        part: dict[str, Any] = {}
        for key, value in saved.items():
            if is_per_element(key, value, shape):
                part[key] = value.reshape(-1)[lo:hi].clone()
            else:
                part[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return part
