"""The parameter-server shard: center variables, the server rule, counters, checkpoints.

Owns: everything one PS process keeps and does. A shard holds one *table* per distributed
optimizer (keyed by the optimizer's ``name``, so one cluster can serve several optimizers, e.g. a
generator and a discriminator). A table is

* the **center variables** of the parameters placed on this shard (``AGNCustomGetter``), stored
  as one flat buffer per dtype (:class:`~distoptim.agn.flat.FlatLayout`), in parameter order;
* the **server rule** the chief seeded it with (:class:`ServerRule`): how a commit changes the
  center — apply a server optimizer (AGN), add (AGN ``"delta"``, DOWNPOUR), elastic pull (EASGD);
* for AGN's default rule, the **server optimizer**: a new instance of the worker's wrapped
  optimizer class with its hyperparameters (per param group), whose state (momentum, Adam
  moments, ...) lives here, over views into the center buffers;
* counters: ``version`` (accepted commits = the global step), commits per worker, refused
  commits, the staleness histogram, bytes in/out.

Concurrency and math of a commit (``commit``), one RPC per shard per worker commit::

    with lock (if use_locking):           # arrival order; no barrier between workers
        staleness = version - version_at_workers_last_pull
        if payload not finite:  refused += 1; reply center            (center untouched)
        else:                   center <- rule(center, payload); version += 1; reply ...

With ``use_locking=False`` additive rules run without the lock (Hogwild!-style: a concurrent
pull may see a partly applied update, as with TF's ``use_locking=False``). A server optimizer's
step is serialized anyway: torch optimizers read gradients from ``.grad``, which two concurrent
commits would overwrite for each other. Counters are always exact (their own lock).

Checkpoints (``checkpoint_dir``): ``ps{shard}.pt`` holds every table (center, rule, optimizer
class/hyperparameters/state, counters). It is written to a temporary file and renamed over the
old one (atomic on POSIX), every ``checkpoint_every`` accepted commits of a table and when the
shard stops. A shard started with an existing checkpoint loads it: its tables are seeded
already, so the chief's seed is ignored (the chief pulls the resumed center like everyone else)
and ``version`` continues.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.agn.flat import FlatLayout, nbytes
from distoptim.comm.link import transmit

__all__ = [
    "AddUpdate",
    "ApplyOptimizer",
    "CommitReply",
    "ParameterServer",
    "PullReply",
    "RemoteError",
    "ServerRule",
    "TableSpec",
]

CHECKPOINT_FORMAT = 1


# ---------------------------------------------------------------------------------------------
# server rules
# ---------------------------------------------------------------------------------------------
class ServerRule:
    """How an accepted commit changes the center (runs on the PS, inside the table's lock).

    ``apply(center, update, optimizer)``: ``center`` and ``update`` are per-variable tensors of
    this shard (``center`` are views into the center buffers and must be changed in place);
    ``optimizer`` is the server optimizer when ``uses_optimizer`` else ``None``.
    ``reply_before_update``: the reply carries the center as it was *before* the update (EASGD
    needs it to move its local copy) instead of after.
    """

    uses_optimizer = False
    reply_before_update = False

    def apply(
        self,
        center: list[torch.Tensor],
        update: list[torch.Tensor],
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class ApplyOptimizer(ServerRule):
    """``center <- server_optimizer.step(center, grad=update)`` (AGN, TF contrib's rule)."""

    uses_optimizer = True

    def apply(self, center, update, optimizer):
        assert optimizer is not None
        for p, g in zip(center, update):
            p.grad = g
        try:
            optimizer.step()
        finally:
            for p in center:
                p.grad = None


class AddUpdate(ServerRule):
    """``center += update`` (AGN ``update_rule="delta"``, DOWNPOUR)."""

    def apply(self, center, update, optimizer):
        torch._foreach_add_(center, update)


# ---------------------------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------------------------
@dataclass
class TableSpec:
    """What the chief tells a shard when it seeds a table.

    ``param_indices``/``shapes``/``dtypes``: the shard's variables, in parameter order.
    ``groups``: for the server optimizer, ``(worker_param_group_index, hyperparameters,
    positions of the shard's variables in that group)``. ``optimizer_cls``/``defaults``: the
    wrapped optimizer's class and defaults (``None`` when the rule uses no optimizer).
    """

    algorithm: str
    rule: ServerRule
    param_indices: list[int]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    use_locking: bool = True
    optimizer_cls: type | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    groups: list[tuple[int, dict[str, Any], list[int]]] = field(default_factory=list)

    def layout(self) -> FlatLayout:
        return FlatLayout(list(zip(self.shapes, self.dtypes)))


@dataclass
class PullReply:
    version: int
    flats: dict[str, torch.Tensor]
    resumed: bool = False


@dataclass
class CommitReply:
    refused: bool
    version: int
    staleness: int
    flats: dict[str, torch.Tensor]


@dataclass
class RemoteError:
    """A server-side error, sent back as a value so the worker re-raises the right type."""

    kind: str
    message: str

    def to_exception(self) -> Exception:
        cls = {"ValueError": ValueError, "TypeError": TypeError}.get(self.kind, RuntimeError)
        return cls(self.message)


# ---------------------------------------------------------------------------------------------
# a table
# ---------------------------------------------------------------------------------------------
def _build_optimizer(spec: TableSpec, views: list[torch.Tensor]) -> torch.optim.Optimizer:
    """A fresh ``spec.optimizer_cls`` over ``views`` with the worker's hyperparameters."""
    assert spec.optimizer_cls is not None
    groups = [{**hp, "params": [views[i] for i in pos]} for _, hp, pos in spec.groups]
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
            f"{spec.optimizer_cls.__name__}(param_groups, **{sorted(kwargs)}): {exc}. AGN's "
            "gradient rule needs an optimizer class constructible from (params, **defaults); "
            "use update_rule='delta' otherwise"
        ) from exc


def _finite(flats: dict[str, torch.Tensor]) -> bool:
    """True iff every element is finite.

    Fast path: a sum reduction (no temporary the size of the buffer) is finite only if every
    term is (NaN and Inf propagate); a non-finite sum may also be an overflow of finite terms,
    so only then is the exact element-wise test run.
    """
    for t in flats.values():
        if not t.is_floating_point():
            continue
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            return False
    return True


class _Table:
    def __init__(self, name: str, spec: TableSpec, flats: dict[str, torch.Tensor]) -> None:
        self.name = name
        self.spec = spec
        self.layout = spec.layout()
        self.flats = {k: v.detach().clone().contiguous() for k, v in flats.items()}
        self.views = self.layout.views(self.flats)
        self.optimizer = _build_optimizer(spec, self.views) if spec.rule.uses_optimizer else None
        self.update_lock = threading.Lock()
        self.stats_lock = threading.Lock()
        self.version = 0
        self.commits: Counter[int] = Counter()
        self.refused = 0
        self.staleness: Counter[int] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        """The lock a center update holds (see the module docstring on ``use_locking``)."""
        if self.spec.use_locking or self.spec.rule.uses_optimizer:
            return self.update_lock
        return contextlib.nullcontext()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.flats.items()}

    def check_worker(self, algorithm: str, signature: tuple, task: int) -> None:
        if algorithm != self.spec.algorithm:
            raise ValueError(
                f"worker {task} runs {algorithm} but optimizer {self.name!r} was seeded by the "
                f"chief as {self.spec.algorithm}: every worker must wrap the same algorithm"
            )
        if signature != self.layout.signature():
            raise ValueError(
                f"worker {task}'s parameters for optimizer {self.name!r} on this shard are "
                f"{list(signature)}, the chief seeded {list(self.layout.signature())}: every "
                "worker must build the same model (same parameter order, shapes and dtypes)"
            )

    def counters(self) -> dict[str, Any]:
        with self.stats_lock:
            return {
                "version": self.version,
                "commits": dict(self.commits),
                "refused": self.refused,
                "staleness": dict(self.staleness),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
            }

    def load_counters(self, c: dict[str, Any]) -> None:
        self.version = int(c["version"])
        self.commits = Counter({int(k): int(v) for k, v in c["commits"].items()})
        self.refused = int(c["refused"])
        self.staleness = Counter({int(k): int(v) for k, v in c["staleness"].items()})
        self.bytes_in = int(c["bytes_in"])
        self.bytes_out = int(c["bytes_out"])

    def state(self) -> dict[str, Any]:
        """Everything a checkpoint keeps, consistent (taken under the update lock)."""
        with self.update_lock:
            opt_state = None
            if self.optimizer is not None:
                buf = io.BytesIO()  # deep copy of the state, detached from live tensors
                torch.save(self.optimizer.state_dict(), buf)
                opt_state = buf.getvalue()
            return {
                "spec": self.spec,
                "flats": self.snapshot(),
                "optimizer": opt_state,
                "counters": self.counters(),
            }

    @classmethod
    def from_state(cls, name: str, state: dict[str, Any]) -> _Table:
        t = cls(name, state["spec"], state["flats"])
        if t.optimizer is not None and state["optimizer"] is not None:
            t.optimizer.load_state_dict(torch.load(io.BytesIO(state["optimizer"])))
        t.load_counters(state["counters"])
        return t


# ---------------------------------------------------------------------------------------------
# the shard
# ---------------------------------------------------------------------------------------------
class ParameterServer:
    """One PS shard (``shard`` of ``num_ps``) serving ``num_worker`` workers.

    The RPC handlers below call its methods; :meth:`wait_for_workers` is the serving loop's
    end condition: every worker has finished or was found dead.
    """

    def __init__(
        self,
        shard: int,
        num_ps: int,
        num_worker: int,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
    ) -> None:
        self.shard = shard
        self.num_ps = num_ps
        self.num_worker = num_worker
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self._tables: dict[str, _Table] = {}
        self._resumed: set[str] = set()
        self._cond = threading.Condition()
        self._finished: set[int] = set()
        self._dead: set[int] = set()
        self._ckpt_lock = threading.Lock()
        self.started = time.monotonic()
        if self.checkpoint_dir is not None:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
            self._load_checkpoint()

    # ---- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> str | None:
        if self.checkpoint_dir is None:
            return None
        return os.path.join(self.checkpoint_dir, f"ps{self.shard}.pt")

    def _load_checkpoint(self) -> None:
        path = self.checkpoint_path
        assert path is not None
        if not os.path.exists(path):
            return
        blob = torch.load(path, weights_only=False)
        if blob.get("format") != CHECKPOINT_FORMAT or blob.get("num_ps") != self.num_ps:
            raise ValueError(
                f"checkpoint {path} was written by a cluster with num_ps={blob.get('num_ps')} "
                f"(format {blob.get('format')}); this one has num_ps={self.num_ps}: restart "
                "with the same number of parameter servers or use another checkpoint_dir"
            )
        for name, state in blob["tables"].items():
            self._tables[name] = _Table.from_state(name, state)
            self._resumed.add(name)

    def checkpoint(self) -> str | None:
        """Write every table to ``ps{shard}.pt`` atomically (temp file + rename)."""
        path = self.checkpoint_path
        if path is None:
            return None
        with self._ckpt_lock:
            with self._cond:
                tables = dict(self._tables)
            blob = {
                "format": CHECKPOINT_FORMAT,
                "shard": self.shard,
                "num_ps": self.num_ps,
                "tables": {n: t.state() for n, t in tables.items()},
            }
            fd, tmp = tempfile.mkstemp(prefix=f".ps{self.shard}.", dir=self.checkpoint_dir)
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save(blob, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return path

    # ---- tables --------------------------------------------------------------------------------
    def _table(self, name: str, wait_s: float = 0.0) -> _Table:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while name not in self._tables:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        f"optimizer {name!r} has no center variables on parameter server "
                        f"{self.shard} yet (waited {wait_s:g}s): the chief seeds them in "
                        "make_session_run_hook(is_chief=True, ...).after_create_session(); is "
                        "a chief running, and did it build the same optimizer name?"
                    )
                self._cond.wait(left)
            return self._tables[name]

    def seed(self, name: str, spec: TableSpec, flats: dict[str, torch.Tensor]) -> PullReply:
        """Create table ``name`` from the chief's values; if it exists (resumed), keep it."""
        if not isinstance(spec, TableSpec) or not isinstance(spec.rule, ServerRule):
            raise TypeError("seed needs a TableSpec with a ServerRule")
        layout = spec.layout()
        layout.check(flats, "seed")
        with self._cond:
            table = self._tables.get(name)
            if table is None:
                table = _Table(name, spec, flats)
                self._tables[name] = table
                self._cond.notify_all()
            else:
                table.check_worker(spec.algorithm, layout.signature(), task=-1)
                if table.spec.rule != spec.rule:
                    raise ValueError(
                        f"optimizer {name!r} exists with rule {table.spec.rule!r}, the chief "
                        f"now seeds {spec.rule!r}"
                    )
        with table.stats_lock:
            table.bytes_in += nbytes(flats)
        return self.pull(name, -1, spec.algorithm, layout.signature(), 0.0)

    def pull(
        self, name: str, task: int, algorithm: str, signature: tuple, wait_s: float
    ) -> PullReply:
        """The current center of this shard (waiting up to ``wait_s`` for the chief's seed)."""
        table = self._table(name, wait_s)
        table.check_worker(algorithm, signature, task)
        with table.guard():
            flats = table.snapshot()
            version = table.version
        out = nbytes(flats)
        with table.stats_lock:
            table.bytes_out += out
        transmit(out)
        return PullReply(version, flats, resumed=name in self._resumed)

    def commit(
        self,
        name: str,
        task: int,
        pulled_version: int,
        payload: dict[str, torch.Tensor],
        hparams: dict[int, dict[str, Any]] | None,
        refused_by_worker: bool,
    ) -> CommitReply:
        """Apply one commit of worker ``task`` (see the module docstring for the math).

        ``payload`` is consumed: its buffers may be reused for the reply.
        """
        table = self._table(name)
        if not refused_by_worker:
            table.layout.check(payload, "commit payload")
        accept = not refused_by_worker and _finite(payload)
        rule = table.spec.rule
        with table.guard():
            staleness = table.version - pulled_version
            reply: dict[str, torch.Tensor] | None = None
            if accept:
                if rule.reply_before_update:
                    reply = table.snapshot()
                if hparams and table.optimizer is not None:
                    _set_hparams(table, hparams)
                rule.apply(table.views, table.layout.views(payload), table.optimizer)
            if reply is None and not table.spec.use_locking:
                reply = dict(table.flats)  # may show a concurrent update, as TF's without locking
            elif reply is None and accept and not _holds(table.optimizer, payload):
                # the payload's buffers are ours and spent: reuse them for the snapshot (no
                # allocation of a model-sized buffer per commit)
                reply = payload
                for k, v in table.flats.items():
                    reply[k].copy_(v)
            elif reply is None:
                reply = table.snapshot()
            with table.stats_lock:
                if accept:
                    table.version += 1
                    table.commits[task] += 1
                    table.staleness[staleness] += 1
                else:
                    table.refused += 1
                table.bytes_in += nbytes(payload)
                table.bytes_out += nbytes(reply)
                version = table.version
        every = self.checkpoint_every
        if (
            accept
            and every is not None
            and self.checkpoint_dir is not None
            and version % every == 0
        ):
            self.checkpoint()
        transmit(nbytes(reply))
        return CommitReply(not accept, version, staleness, reply)

    # ---- workers' lifecycle ----------------------------------------------------------------------
    def finish(self, task: int, failed: bool) -> None:
        with self._cond:
            (self._dead if failed else self._finished).add(task)
            self._cond.notify_all()

    def is_finished(self, task: int) -> bool:
        with self._cond:
            return task in self._finished

    def wait_for_workers(
        self,
        probe: Callable[[Sequence[int]], Sequence[int]],
        probe_period_s: float = 1.0,
        timeout_s: float | None = None,
    ) -> None:
        """Return once every worker has finished or was found dead.

        Wakes at every ``finish``; every ``probe_period_s`` without news it calls
        ``probe(pending_tasks)``, which returns the tasks whose process is gone. A task that
        finished meanwhile is never counted dead. ``timeout_s`` bounds the whole wait.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._cond:
                pending = [
                    t for t in range(self.num_worker) if t not in self._finished | self._dead
                ]
                if not pending:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"parameter server {self.shard}: workers {pending} neither finished nor "
                        f"died within {timeout_s:g}s"
                    )
                self._cond.wait(probe_period_s)
                pending = [
                    t for t in range(self.num_worker) if t not in self._finished | self._dead
                ]
            if pending:
                gone = probe(pending)
                with self._cond:
                    self._dead.update(t for t in gone if t not in self._finished)

    # ---- read-outs -------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """This shard's tables (param indices, center per parameter, counters) and workers."""
        with self._cond:
            tables = dict(self._tables)
            dead = sorted(self._dead)
            finished = sorted(self._finished)
        out: dict[str, Any] = {}
        for name, t in tables.items():
            with t.guard():
                flats = t.snapshot()
            out[name] = {
                "param_indices": list(t.spec.param_indices),
                "center": [v.clone() for v in t.layout.views(flats)],
                "counters": t.counters(),
                "algorithm": t.spec.algorithm,
                "resumed": name in self._resumed,
            }
        return {
            "shard": self.shard,
            "tables": out,
            "dead_workers": dead,
            "finished_workers": finished,
            "wall_time_s": time.monotonic() - self.started,
        }


def _holds(optimizer: torch.optim.Optimizer | None, flats: dict[str, torch.Tensor]) -> bool:
    """Whether ``optimizer``'s state keeps a reference into ``flats`` (e.g. a kept gradient)."""
    if optimizer is None:
        return False
    ptrs = {t.untyped_storage().data_ptr() for t in flats.values()}
    return any(
        isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in ptrs
        for state in optimizer.state.values()
        for v in state.values()
    )


def _set_hparams(table: _Table, hparams: dict[int, dict[str, Any]]) -> None:
    """Follow the workers' hyperparameters (LR schedules) on the server optimizer's groups."""
    assert table.optimizer is not None
    for group, (worker_group, _, _) in zip(table.optimizer.param_groups, table.spec.groups):
        hp = hparams.get(worker_group)
        if hp:
            for k, v in hp.items():
                if (
                    k != "params"
                    and isinstance(v, (int, float))
                    and not (isinstance(v, float) and math.isnan(v))
                ):
                    group[k] = v


# ---------------------------------------------------------------------------------------------
# RPC entry points (run on the PS's RPC thread pool)
# ---------------------------------------------------------------------------------------------
_SERVER: ParameterServer | None = None


def install(server: ParameterServer | None) -> None:
    """Make ``server`` the shard the RPC handlers of this process serve."""
    global _SERVER
    _SERVER = server


def _serve(method: str, *args: Any) -> Any:
    server = _SERVER
    if server is None:
        return RemoteError("RuntimeError", "this process is not a parameter server")
    try:
        return getattr(server, method)(*args)
    except (ValueError, TypeError, RuntimeError, TimeoutError) as exc:
        return RemoteError(type(exc).__name__, str(exc))


def rpc_seed(name: str, spec: TableSpec, flats: dict[str, torch.Tensor]) -> Any:
    return _serve("seed", name, spec, flats)


def rpc_pull(name: str, task: int, algorithm: str, signature: tuple, wait_s: float) -> Any:
    return _serve("pull", name, task, algorithm, signature, wait_s)


def rpc_commit(
    name: str,
    task: int,
    pulled_version: int,
    payload: dict[str, torch.Tensor],
    hparams: dict[int, dict[str, Any]] | None,
    refused_by_worker: bool,
) -> Any:
    return _serve("commit", name, task, pulled_version, payload, hparams, refused_by_worker)


def rpc_finish(task: int, failed: bool) -> Any:
    return _serve("finish", task, failed)


def rpc_ping() -> int:
    return os.getpid()
