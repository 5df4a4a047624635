"""DiLoCo's checkpoints through ``torch.distributed.checkpoint`` (DCP), resharded on load.

Owns the DCP format of the outer family (:class:`DiLoCoShardedState`, a mixin of
:class:`~distoptim.outer.diloco.DiLoCo`): what ``sharded_state_dict()`` exposes, how
``save_sharded`` / ``load_sharded`` run DCP, and how a loaded checkpoint is put back in this
process's layout. ``state_dict()`` keeps its own format (each process's local shards, loadable
only into the same layout); this one carries the layout, so a checkpoint of ``n`` replica
groups of ``k`` processes loads into ``n`` groups of any ``k'`` (FSDP2 ``Shard(0)`` over 2 into
one process, plain tensors, TP, ...). ``docs/groups.md`` describes it.

Every per-element tensor is a ``DTensor`` on its parameter's mesh and placements (what the
process holds of it: its local shard), or a plain tensor for a plain parameter, keyed by the
parameter's index ``i`` in the inner optimizer's order, so DCP writes each piece once and reads,
on load, whatever pieces overlap what the loading process holds::

    distoptim                 (SHARDED_FORMAT, header)    replicated: written once
    global.<i>                the global copy θ_g            the same in every replica group
    outer.state.<j>.<key>     the outer optimizer's state    (j: its own state_dict index)
    replica.<g>.params.<i>    replica group g's parameters   (differ between syncs)
    replica.<g>.inner.state.<j>.<key>   its inner optimizer's state
    replica.<g>.inner.iterations        the inner's own step count (a Keras-style inner's)
    replica.<g>.inner.wrapped_iterations, ...   those of the optimizers a wrapper inner wraps
    replica.<g>.residual.<i>  its error-feedback residual of Δ (lossy wires)
    shard_residual.<h>.<i>    the mean's residual that cross-group rank h keeps (two-phase wires)

The header holds the configuration (but the group's layout), the global shapes and dtypes,
both optimizers' param groups and the counters. Residuals are elementwise: a bucket's residual
of ``Δ`` (``"local"``) is one value per element of the bucket's parameters, so it is saved as a
tensor shaped like each parameter; the two-phase mean's residual (``"shard"``) covers the shard
of the bucket that cross-group rank ``h`` averages, so each ``h`` saves its values where they
lie in the parameters (zero elsewhere) and a loading process takes, for each element of its new
shard, the value of the rank that held it. What a bucket's padding holds (the error of encoding
zeros) is zero. Replica group ``g`` is this process's rank in the cross-group channel.

Under a torchft manager the replica groups are the quorum's, which comes and goes, and each
group runs its own ``torch.distributed`` world: every group saves its own checkpoint, over its
own processes (``process_group=``: the default one in a torchft group), and its entries are
keyed ``0`` whatever its rank in the quorum (``replica.0.*``, ``shard_residual.0.*``), so any
group may load any group's checkpoint. The header adds, per fragment, the ``[size, rank]`` of
the quorum the residuals were laid out for (``quorum``; ``None`` without a manager): a loading
optimizer binds its exchanges to that layout (:class:`~distoptim.outer.state.UnboundChannel`)
and the first sync's quorum rebinds them -- with the same layout (the same membership) the
residuals are kept, as in the uninterrupted run, with another (e.g. a third group) they restart
from zero, as they would have there. With another ``k`` the two-phase residual keeps the values
of the elements its new shard shares with the old one (the group's checkpoint holds only the
shard it averaged), zero elsewhere. A managed checkpoint and one without a manager do not load
into each other (``num_replicas`` 0, the quorum's, against ``n``).

Not held: a sync in flight (``sharded_state_dict()`` refuses one: save when nothing is in flight,
e.g. after ``finish()`` or at a step where Streaming DiLoCo's ``τ`` has passed), the model's
buffers (the user's, with the model's own ``state_dict``), the torchft manager's own step
(``manager.state_dict()``, the user's), and a ``CrossShardOptimizer`` inner (it has its own
per-rank format).

Before anything changes every process reads the same header and metadata and makes the same
checks (:func:`~distoptim.outer.checkpoint.check_sharded_header`, then the saved entries
against this optimizer); a misfit is :class:`CheckpointMismatchError`, a failure of DCP itself
(a missing file, ...) :class:`~distoptim.sync.sharded_checkpoint.CheckpointError`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distoptim import checks
from distoptim.outer.checkpoint import (
    SHARDED_FORMAT,
    ExchangeLayout,
    check_quorum_layout,
    check_sharded_header,
    layout_free,
)
from distoptim.outer.exchange import FragmentExchange
from distoptim.outer.fragments import FragmentSchedule
from distoptim.outer.groups import is_dtensor, like_param, local_view
from distoptim.outer.state import UnboundChannel
from distoptim.protocol import TFOptimizerProtocol, check_inner_state_dict, is_step_count
from distoptim.sync.sharded_checkpoint import CheckpointError, dcp_errors, dotted, nest, unnest

__all__ = ["HEADER", "CheckpointMismatchError", "DiLoCoShardedState"]

HEADER = "distoptim"
"""The header's key."""
_RESIDUALS = ("local", "shard")
"""The residual names this format knows (a two-phase mean keeps both, top-k ``"local"``)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A DCP checkpoint that does not fit this optimizer, refused before anything changes."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _blank(p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A template shaped like what this process holds of ``p``, as ``p``'s kind."""
    return like_param(torch.empty_like(local_view(p).detach(), dtype=dtype), p)


class DiLoCoShardedState:
    """The DCP checkpoint methods of :class:`~distoptim.outer.diloco.DiLoCo` (a mixin: it reads
    the optimizer's attributes, declared here for type checkers, and calls its ``_config()``
    and ``_peer_guard()``)."""

    _name: str
    iterations: int
    _params: list[torch.Tensor]
    _global: list[torch.Tensor]
    _outer: torch.optim.Optimizer
    _exchanges: list[FragmentExchange]
    _schedule: FragmentSchedule
    _syncs: int
    _synced_at: list[int]
    _closed_at: int
    _in_flight: Any
    _managed: Any
    _channel: Any
    wrapped: torch.optim.Optimizer
    _template: Callable[[FragmentExchange, tuple[int, int]], ExchangeLayout]

    # ---- save --------------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict[str, Any]:
        """This process's part of a DCP checkpoint (the module's format; local, no collective).

        Raises ``ValueError`` with a sync in flight or with a ``CrossShardOptimizer`` inner
        (see the module). Under a torchft manager: this replica group's own checkpoint.
        """
        self._check_sharded_use("sharded_state_dict()")
        if self._in_flight is not None:
            raise ValueError(
                f"{self._name}.sharded_state_dict() at step {self.iterations}: the sync of "
                f"fragment {self._in_flight.fragment.index} is in flight, which a DCP "
                "checkpoint does not hold; save at a step with nothing in flight (after "
                "finish(), or fragment_sync_delay steps after a launch), or use state_dict()"
            )
        g = self._replica_key()
        replica: dict[str, Any] = {
            "params": {str(i): p.detach() for i, p in enumerate(self._params)},
            "inner": _inner_entries(self.wrapped),
        }
        out: dict[str, Any] = {
            HEADER: (SHARDED_FORMAT, self._sharded_header()),
            "global": {str(i): like_param(t, p) for i, (t, p) in self._indexed(self._global)},
            "outer": {"state": _state_entries(self._outer)},
            "replica": {g: replica},
        }
        names = self._residual_names()
        if "local" in names:
            local = self._residual_per_param("local")
            replica["residual"] = {str(i): like_param(local[i], p) for i, p in self._indexed()}
        if "shard" in names:
            shard = self._residual_per_param("shard")
            out["shard_residual"] = {
                g: {str(i): like_param(shard[i], p) for i, p in self._indexed()}
            }
        return out

    def _replica_key(self) -> str:
        """The key of this replica group's entries: its rank in the cross-group channel, or
        ``"0"`` under a torchft manager (each group saves its own checkpoint; see the module)."""
        return "0" if self._managed is not None else str(self._channel.rank)

    def _quorum_layout(self) -> list[list[int]] | None:
        """Under a manager, per fragment the ``[size, rank]`` of the quorum its residuals are
        laid out for (``[1, 0]``: none met yet); ``None`` without one."""
        if self._managed is None:
            return None
        return [
            [e.channel.size, e.channel.rank if e.channel.size > 1 else 0] for e in self._exchanges
        ]

    def save_sharded(
        self, checkpoint_id: str | os.PathLike[str], *, process_group: Any = None
    ) -> None:
        """``dcp.save(self.sharded_state_dict(), checkpoint_id=...)``: a collective over
        ``process_group`` (default: every process), every process of every replica group --
        under a torchft manager, of this replica group (each group saves its own)."""
        import torch.distributed.checkpoint as dcp

        checks.check_type("checkpoint_id", checkpoint_id, (str, os.PathLike), "a path")
        state = self.sharded_state_dict()
        with dcp_errors("save", checkpoint_id):
            dcp.save(state, checkpoint_id=checkpoint_id, process_group=process_group)

    def _sharded_header(self) -> dict[str, Any]:
        return {
            "config": layout_free(self._config()),
            "iterations": self.iterations,
            "syncs": self._syncs,
            "synced_at": list(self._synced_at),
            "closed_at": self._closed_at,
            "shapes": [tuple(p.shape) for p in self._params],
            "dtypes": [str(p.dtype) for p in self._params],
            "residuals": self._residual_names(),
            "inner_groups": self.wrapped.state_dict()["param_groups"],
            "outer_groups": self._outer.state_dict()["param_groups"],
            "quorum": self._quorum_layout(),
        }

    # ---- load --------------------------------------------------------------------------------
    def load_sharded(
        self,
        checkpoint_id: str | os.PathLike[str],
        prefix: str = "",
        *,
        process_group: Any = None,
    ) -> None:
        """Load a DCP checkpoint of :meth:`sharded_state_dict` saved by replica groups of any
        number of processes (the same number of groups, the same configuration; under a torchft
        manager one group's checkpoint, any number of groups), each process reading what it
        holds in its current layout. ``prefix``: where the entries sit when
        saved nested (``"optim"`` for ``{"optim": opt.sharded_state_dict()}``). Checked
        before anything changes (:class:`CheckpointMismatchError`). A collective over
        ``process_group`` (default: every process)."""
        import torch.distributed.checkpoint as dcp

        checks.check_type("checkpoint_id", checkpoint_id, (str, os.PathLike), "a path")
        checks.check_type("prefix", prefix, str, "a str")
        self._check_sharded_use("load_sharded()")
        where = dotted(prefix)
        with dcp_errors("load", checkpoint_id):
            metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
        saved = metadata.state_dict_metadata
        if f"{where}{HEADER}" not in saved:
            raise CheckpointMismatchError(
                f"{os.fspath(checkpoint_id)!r} is not a {self._name} DCP checkpoint"
                + (f" under {prefix!r}" if prefix else "")
                + f": no {where}{HEADER} entry (it holds {sorted(saved)[:3]}...)"
            )
        head = nest({HEADER: None}, where)
        with dcp_errors("load", checkpoint_id, metadata):
            dcp.load(head, checkpoint_id=checkpoint_id, process_group=process_group)
        layouts: list[tuple[int, int]] = []  # managed: the saved quorum layout, per fragment

        def residual_names(quorum: Any) -> list[str]:
            if self._managed is None:
                return self._residual_names()
            layouts.extend(check_quorum_layout(self._name, quorum, len(self._exchanges)))
            return self._residual_names(layouts)

        try:
            fields = check_sharded_header(
                unnest(head, where)[HEADER],
                owner=self._name,
                config=self._config(),
                shapes=[tuple(p.shape) for p in self._params],
                dtypes=[p.dtype for p in self._params],
                residuals=residual_names,
                schedule=self._schedule,
            )
            names = self._residual_names(layouts or None)
            template = self._sharded_template(saved, where, names)
        except ValueError as exc:
            raise CheckpointMismatchError(str(exc)) from exc
        nested = nest(template, where)
        with dcp_errors("load", checkpoint_id, metadata):
            dcp.load(nested, checkpoint_id=checkpoint_id, process_group=process_group)
        loaded = unnest(nested, where)
        replica = loaded["replica"][self._replica_key()]
        inner_sd = {
            "state": _unkeyed(replica["inner"]["state"]),
            "param_groups": fields["inner_groups"],
        }
        counts = [k for k in replica["inner"] if is_step_count(k)]
        for key in counts if isinstance(self.wrapped, TFOptimizerProtocol) else ():
            count = replica["inner"][key]
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise CheckpointMismatchError(
                    f"{self._name} DCP checkpoint: replica.{self._replica_key()}.inner.{key} "
                    f"must be an int >= 0, it holds {count!r}"
                )
            inner_sd[key] = count
        outer_sd = {
            "state": _unkeyed(loaded["outer"]["state"]),
            "param_groups": fields["outer_groups"],
        }
        try:
            check_inner_state_dict(self.wrapped, inner_sd)
            check_inner_state_dict(self._outer, outer_sd)
        except (TypeError, ValueError) as exc:
            raise CheckpointMismatchError(f"{self._name} DCP checkpoint: {exc}") from exc
        shard = None
        if "shard_residual" in loaded:
            shard = _owned_values(loaded["shard_residual"], len(self._params))
        # -- everything checked: from here on nothing raises --
        self._apply_sharded(fields, loaded, replica, shard, layouts)
        self.wrapped.load_state_dict(inner_sd)
        self._outer.load_state_dict(outer_sd)

    def _sharded_template(
        self, saved: dict[str, Any], where: str, names: Sequence[str]
    ) -> dict[str, Any]:
        """What this process asks DCP for, in its layout (``names``: the residuals kept);
        ``ValueError`` if an entry is missing or of another global shape or dtype than this
        optimizer's."""
        g = self._replica_key()
        # every cross-group rank's part of the two-phase residual; under a manager the group's
        parts = ["0"] if self._managed is not None else [str(h) for h in range(self._channel.size)]

        def like(key: str, p: torch.Tensor) -> torch.Tensor:
            md = saved.get(f"{where}{key}")
            size, dtype = (
                getattr(md, "size", None),
                getattr(getattr(md, "properties", None), "dtype", None),
            )
            if size is None or tuple(size) != tuple(p.shape) or dtype != p.dtype:
                got = (
                    "nothing"
                    if md is None
                    else f"{dtype} {tuple(size) if size is not None else md}"
                )
                raise ValueError(
                    f"{self._name} DCP checkpoint: {where}{key} must be a {p.dtype} tensor of "
                    f"the parameter's global shape {tuple(p.shape)}, it holds {got}"
                )
            return _blank(p)

        replica: dict[str, Any] = {
            "params": {str(i): like(f"replica.{g}.params.{i}", p) for i, p in self._indexed()},
            "inner": {
                "state": _state_template(saved, f"{where}replica.{g}.inner.state.", self.wrapped)
            },
        }
        inner = f"{where}replica.{g}.inner."
        for key in saved:  # the step counts saved (checkpoints before they were: none)
            if key.startswith(inner) and is_step_count(key[len(inner) :]):
                replica["inner"][key[len(inner) :]] = None  # a Python value: DCP puts it here
        out: dict[str, Any] = {
            HEADER: None,
            "global": {str(i): like(f"global.{i}", p) for i, p in self._indexed()},
            "outer": {"state": _state_template(saved, f"{where}outer.state.", self._outer)},
            "replica": {g: replica},
        }
        if "local" in names:
            replica["residual"] = {
                str(i): like(f"replica.{g}.residual.{i}", p) for i, p in self._indexed()
            }
        if "shard" in names:
            out["shard_residual"] = {
                h: {str(i): like(f"shard_residual.{h}.{i}", p) for i, p in self._indexed()}
                for h in parts
            }
        return out

    def _apply_sharded(
        self,
        fields: dict[str, Any],
        loaded: dict[str, Any],
        replica: dict[str, Any],
        shard: list[torch.Tensor] | None,
        layouts: Sequence[tuple[int, int]],
    ) -> None:
        """Put the checked checkpoint back (the optimizers' states are loaded by the caller).
        ``layouts``: under a manager, the saved quorum layout of every fragment, which its
        exchange takes until the first sync's quorum rebinds it (see the module)."""
        if self._in_flight is not None:  # its collective was launched on every rank: drain it
            with self._peer_guard("waiting for the sync in flight", self.iterations):
                self._exchanges[self._in_flight.fragment.index].settle(self._in_flight.flight)
            self._in_flight = None
        for exchange, (size, rank) in zip(self._exchanges, layouts):
            if (exchange.channel.size, exchange.channel.rank) != (size, rank) and (
                size > 1 or exchange.channel.size > 1
            ):
                exchange.rebind(UnboundChannel(size, rank))
        with torch.no_grad():
            for i, p in self._indexed():
                local_view(p).copy_(_local(replica["params"][str(i)]))
                self._global[i].copy_(_local(loaded["global"][str(i)]))
            if "residual" in replica:
                values = [_local(replica["residual"][str(i)]) for i in range(len(self._params))]
                self._write_residual("local", values)
            if shard is not None:
                self._write_residual("shard", shard)
        self.iterations = fields["iterations"]
        self._syncs = fields["syncs"]
        self._synced_at = list(fields["synced_at"])
        self._closed_at = fields["closed_at"]

    # ---- residuals per parameter -------------------------------------------------------------
    def _residual_names(self, layouts: Sequence[tuple[int, int]] | None = None) -> list[str]:
        """The residuals kept, by the exchanges as they are or (``layouts``: per fragment a
        channel's ``(size, rank)``) as they would be over those channels."""
        held = (
            [e.residuals for e in self._exchanges]
            if layouts is None
            else [self._template(e, lay).residuals for e, lay in zip(self._exchanges, layouts)]
        )
        names = sorted({k for residuals in held for r in residuals for k in r})
        unknown = [k for k in names if k not in _RESIDUALS]
        if unknown:  # a wire whose residuals this format does not know how to lay out
            raise ValueError(f"{self._name}: residuals {unknown} have no DCP layout")
        return names

    def _buckets(self) -> list[tuple[int, Any, dict[str, torch.Tensor], int, int]]:
        """Per bucket with residuals: (its fragment's first parameter, the bucket, its
        residuals, the size of the two-phase shard this process averages, this process's rank
        in the channel its exchange is bound to: which shard that is)."""
        out = []
        for fragment, exchange in zip(self._schedule.fragments, self._exchanges):
            for bucket, res in zip(exchange.plan.buckets, exchange.residuals):
                size = res["shard"].numel() if "shard" in res else 0
                out.append((fragment.start, bucket, res, size, exchange.channel.rank))
        return out

    def _residual_per_param(self, name: str) -> list[torch.Tensor]:
        """Residual ``name`` as one tensor per parameter, shaped like its local tensor: the
        ``"local"`` one a view of the bucket's, the ``"shard"`` one zero outside this process's
        shard of the bucket."""
        out: list[torch.Tensor | None] = [None] * len(self._params)
        for start, bucket, res, size, rank in self._buckets():
            flat = res[name]
            if name == "shard":
                flat = flat.new_zeros(bucket.numel)
                lo, hi = rank * size, min((rank + 1) * size, bucket.numel)
                if lo < hi:
                    flat[lo:hi] = res["shard"][: hi - lo]
            for member, view in zip(bucket.members, bucket.views(flat)):
                out[start + member] = view
        return out  # type: ignore[return-value]  # every parameter is in one bucket

    def _write_residual(self, name: str, values: Sequence[torch.Tensor]) -> None:
        """Write per-parameter residuals (:meth:`_residual_per_param`'s form) into the buckets."""
        for start, bucket, res, size, rank in self._buckets():
            flat = torch.cat([values[start + m].reshape(-1) for m in bucket.members])
            if name == "local":
                res["local"].zero_()
                res["local"][: bucket.numel].copy_(flat)
            else:
                lo, hi = rank * size, min((rank + 1) * size, bucket.numel)
                res["shard"].zero_()
                if lo < hi:
                    res["shard"][: hi - lo].copy_(flat[lo:hi])

    # ---- helpers -----------------------------------------------------------------------------
    def _indexed(self, tensors: Sequence[torch.Tensor] | None = None) -> Any:
        """``(i, p)`` over the parameters, or ``(i, (tensors[i], p))``."""
        if tensors is None:
            return enumerate(self._params)
        return enumerate(zip(tensors, self._params))

    def _check_sharded_use(self, what: str) -> None:
        from distoptim.sync.optimizer import CrossShardOptimizer

        if isinstance(self.wrapped, CrossShardOptimizer):
            raise ValueError(
                f"{self._name}.{what} with a CrossShardOptimizer inner: its state has its own "
                "per-rank format (inner.save_sharded); use state_dict() here"
            )


def _inner_entries(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The inner optimizer's per-parameter state, and its own step count when it keeps one (a
    Keras-style optimizer, whose schedule and EMA read it: ``distoptim.dtensor.SGD``), and, when
    it is a wrapper, those of the optimizers it wraps however deep (``"wrapped_iterations"``,
    ...: the mesh SGD under a ``WrappedOptimizer`` keeps its schedule's step too)."""
    sd = opt.state_dict()
    out: dict[str, Any] = {"state": {str(j): dict(e) for j, e in sd["state"].items()}}
    if isinstance(opt, TFOptimizerProtocol):
        out.update({k: int(v) for k, v in sd.items() if is_step_count(k)})
    return out


def _state_entries(opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """``opt``'s per-parameter state by its state_dict index (strings: DCP's keys)."""
    return {str(j): dict(entry) for j, entry in opt.state_dict()["state"].items()}


def _unkeyed(state: dict[str, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {int(j): entry for j, entry in state.items()}


def _state_template(saved: dict[str, Any], head: str, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A template for ``opt``'s saved state under ``head``: a tensor of the parameter's global
    shape in its layout (its kind), any other tensor as saved, a Python value as ``None``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    params = [p for g in opt.param_groups for p in g["params"]]
    out: dict[str, dict[str, Any]] = {}
    for fqn, md in saved.items():
        if not fqn.startswith(head):
            continue
        index, _, key = fqn[len(head) :].partition(".")
        if not index.isdigit() or int(index) >= len(params) or not key:
            raise ValueError(
                f"DCP checkpoint: {fqn} is the state of no parameter of this {type(opt).__name__} "
                f"({len(params)} parameters)"
            )
        p = params[int(index)]
        if not isinstance(md, TensorStorageMetadata):
            value = None  # a Python value: DCP puts it here
        elif tuple(md.size) == tuple(p.shape) and p.dim() > 0:
            value = _blank(p, md.properties.dtype)
        else:
            value = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        out.setdefault(index, {})[key] = value
    return out


def _owned_values(parts: dict[str, dict[str, torch.Tensor]], count: int) -> list[torch.Tensor]:
    """Per parameter, the two-phase residual from the saved parts of every cross-group rank
    (each zero outside what that rank averaged): each element from the part that holds it, a
    value other than ``+0.0`` (so a held ``-0.0`` is kept bitwise)."""
    out = []
    for i in range(count):
        values = [_local(parts[h][str(i)]) for h in sorted(parts, key=int)]
        acc = values[0].clone()
        for v in values[1:]:
            held = (v != 0) | torch.signbit(v)
            acc = torch.where(held, v, acc)
        out.append(acc)
    return out
