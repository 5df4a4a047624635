"""Processes of torchft replica groups of several processes each, for tests/ft/test_group_heal.py.

One *member* is one process of one replica group: the group's processes form their own gloo
world (over a TCPStore the test process hosts, one per group incarnation), shard the model with
FSDP2 (``fully_shard`` over the group's 1-D mesh), and each has a ``torchft.Manager`` with the
group's ``replica_id`` and its own group rank; DiLoCo (``manager=``) runs across the groups, so
every process averages its shards with its counterpart's (the same group rank) in every other
group -- or, with ``algorithm="cross_shard"``, ``CrossShardOptimizer(manager=)`` does at every
step (torchtitan + torchft's HSDP; a committed step counts as a sync). Module-level functions:
the supervisor starts processes with the ``spawn`` method.

Each member appends JSON lines to its own log (flushed, so they survive a SIGKILL): ``ready``;
``failed`` with the error that ends it (a group that lost one
of its processes fails in the survivor's next collective inside the group); ``inject`` when its
fault trigger fires (:mod:`distoptim.ft.inject`; its training then hangs there, for the test to
kill: the main thread blocks, the rest of the process runs on -- see :func:`_hang`);
``serving`` when it copies its state for a healing peer and
``loading`` when it loads one (each with the sender's group, rank and a checksum of what was
sent, so the test sees who healed from whom); ``commit`` after every committed sync (the sync
count, the participants, whether this process contributed, and the checksum of its shards of
the state every replica must agree on).

When to stop is decided from what every process of every group sees alike, never from the
clock: the first committed sync with every group contributing after one with fewer (a process
of the first incarnation: the others went on without the dead group, then it came back), or,
in a restarted process, the first committed sync it contributed to. Every member of every group
commits that same sync, so all stop at the same step. A run without restarts (``end_at_sync``)
stops after that many committed syncs.

:func:`restarted_manager` is one process of a group restarted on its old store (torchrun's
``--max-restarts``), where the dead incarnation's manager address is still published.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MAX_STEPS = 20_000  # a bound, in case the run never reaches its end (the test then fails)
DIM, HIDDEN, CLASSES, ROWS = 8, 16, 4, 8  # a group's batch: ROWS rows, split over its processes
SYNC_EVERY = 4


@dataclass(frozen=True)
class Member:
    """One process of one replica group, as the test starts it."""

    group: int
    rank: int  # its rank inside the group (torchft's group_rank)
    size: int  # processes per group
    groups: int  # replica groups of the run
    incarnation: int  # 0 for the first processes of the group, 1 after a restart
    lighthouse: str
    store_port: int  # the group incarnation's TCPStore (hosted by the test process)
    log_path: str
    faults: str = ""  # an inject trigger spec armed in this process ("" for none)
    perturb: bool = False  # add 1e-3 to this process's shard of the global copy after sync 2
    end_at_sync: int = 0  # > 0: stop after this many committed syncs instead (no restart)
    start_barrier: Any = None  # the first incarnations' start line
    algorithm: str = "diloco"  # or "cross_shard": CrossShardOptimizer(manager=) over the shards

    def log(self, kind: str, **data: Any) -> None:
        record = {"kind": kind, "t": time.time(), "group": self.group, "rank": self.rank}
        record.update(inc=self.incarnation, **data)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _checksum(tensors: list[torch.Tensor]) -> int:
    from distoptim.comm.checksum import state_checksum

    return state_checksum([_local(t).detach() for t in tensors])


def _state_tensors(opt: Any) -> list[torch.Tensor]:
    """The outer optimizer's state tensors (Nesterov momentum: local-shard DTensors)."""
    out = []
    for state in opt.state.values():
        out += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return out


def _batch(group: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group``'s batch of inner step ``step`` (it follows the step, so a healed group
    trains on what it would have); process ``rank`` takes its ``1/size`` of the rows."""
    g = torch.Generator().manual_seed(10_000 * group + step)
    x = torch.randn(ROWS, DIM, generator=g)
    y = torch.randint(CLASSES, (ROWS,), generator=g)
    rows = slice(rank * ROWS // size, (rank + 1) * ROWS // size)
    return x[rows], y[rows]


def member(m: Member) -> dict[str, Any]:
    """Train one process of one replica group under torchft until the run's end (module doc)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distoptim import CrossShardOptimizer, DiLoCo
    from distoptim.ft import inject
    from distoptim.ft.replica import make_manager

    m.log("process", pid=os.getpid())
    store = dist.TCPStore(
        "127.0.0.1", m.store_port, is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("inside", store),
        rank=m.rank,
        world_size=m.size,
        timeout=datetime.timedelta(seconds=120),
    )
    mesh = init_device_mesh("cpu", (m.size,), mesh_dim_names=("shard",))
    torch.manual_seed(0)  # every process of every group builds the same model
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    model.in_pass = False  # between a forward pass's start and its backward's end (_train)
    model.register_forward_pre_hook(lambda *_: setattr(model, "in_pass", True))

    def state() -> dict[str, Any]:  # what this process's counterpart receives when it heals
        in_pass = model.in_pass  # torchft's quorum thread reads it: see test_group_heal
        model_state = {k: _local(v).detach().clone() for k, v in model.state_dict().items()}
        sent = {"model": model_state, "inner": inner.state_dict()}
        mark = _checksum(list(model_state.values()))
        m.log("serving", sent=mark, in_pass=in_pass)
        return {"from_group": m.group, "from_rank": m.rank, "sum": mark, **sent}

    def load(saved: dict[str, Any]) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                _local(v).copy_(saved["model"][k])
        inner.load_state_dict(saved["inner"])
        got = _checksum([_local(v) for v in model.state_dict().values()])
        m.log(
            "loading",
            from_group=saved["from_group"],
            from_rank=saved["from_rank"],
            sent=saved["sum"],
            got=got,
        )

    manager = make_manager(
        m.lighthouse,
        replica_id=f"group_{m.group}",
        state_dict=state,
        load_state_dict=load,
        min_replica_size=1,  # the survivors go on without a dead group
        rank=m.rank,
        world_size=m.size,
        store_addr="127.0.0.1",
        store_port=m.store_port,
        timeout=60,
        quorum_timeout=240,
        connect_timeout=60,
        init_sync=False,
    )
    try:
        if m.algorithm == "cross_shard":
            opt: Any = _Steps(CrossShardOptimizer(inner, manager=manager), model)
            outer = inner  # its state is the inner optimizer's
        else:
            opt = DiLoCo(inner, outer, sync_every=SYNC_EVERY, manager=manager)
        if m.faults:

            def stop_here(point: str, role: str) -> None:
                m.log("inject", point=point, role=role, syncs=opt.syncs, step=opt.iterations)
                _hang()  # here until the test kills it

            inject.arm(m.faults, action=stop_here)
        m.log("ready")
        if m.start_barrier is not None:
            m.start_barrier.wait(240)
        return _train(m, model, opt, outer, manager)
    except Exception as exc:  # e.g. its group lost a process: logged, then raised
        m.log("failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()
        m.log("returned")


class _Steps:
    """A managed CrossShardOptimizer as :func:`_train` reads a DiLoCo: every committed step is
    a sync, and the state every replica must agree on is the model's shards (with the inner
    optimizer's state, which :func:`_train` reads as ``outer``'s)."""

    def __init__(self, opt: Any, model: nn.Module) -> None:
        self.opt = opt
        self.global_parameters = list(model.parameters())

    @property
    def iterations(self) -> int:
        return self.opt.iterations

    @property
    def syncs(self) -> int:
        return self.opt.iterations

    @property
    def replica_stats(self) -> Any:
        return self.opt.replica_stats

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.step()

    def finish(self) -> None:
        self.opt.finish()


def _hang() -> None:
    """Block this process's training (its main thread) until it is killed.

    Not SIGSTOP: group rank 0's process also hosts the group's torchft ``ManagerServer``, which
    answers each group rank's quorum request in a task of its own. Rank 0 may have its answer
    -- and stop -- before the server has sent rank 1 its answer to the same quorum; a frozen
    process would then hold rank 1 short of the point it is to stop at, until torchft's
    client gives up on the silent server (HTTP/2 keep-alive: 80 s, ``http2 error``). A hung
    training loop is the fault this test injects; its manager goes on serving its group.
    """
    while True:
        signal.pause()  # any signal but the SIGKILL that ends it returns here


def _train(m: Member, model: nn.Module, opt: Any, outer: Any, manager: Any) -> dict[str, Any]:
    short_seen = False
    while opt.iterations < MAX_STEPS:
        x, y = _batch(m.group, opt.iterations, m.rank, m.size)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        model.in_pass = False
        syncs, contributed = opt.syncs, opt.replica_stats.contributed
        opt.step()
        if opt.syncs == syncs:
            continue
        participants = manager.num_participants()
        mine = opt.replica_stats.contributed > contributed
        if m.perturb and opt.syncs == 2:  # this process's copy of its shard is off: the fault
            with torch.no_grad():
                _local(opt.global_parameters[0]).add_(1e-3)
        m.log(
            "commit",
            syncs=opt.syncs,
            step=opt.iterations,
            participants=participants,
            contributed=mine,
            heals=opt.replica_stats.heals,
            state=_checksum([*opt.global_parameters, *_state_tensors(outer)]),
        )
        short_seen = short_seen or participants < m.groups
        if m.end_at_sync:
            if opt.syncs >= m.end_at_sync:
                break
        elif participants == m.groups and (mine if m.incarnation else short_seen):
            break
    opt.finish()
    stats = opt.replica_stats
    return {
        "step": opt.iterations,
        "syncs": opt.syncs,
        "state": _checksum([*opt.global_parameters, *_state_tensors(outer)]),
        "model": _checksum(list(model.parameters())),
        "whole": _checksum([p.full_tensor() for p in model.parameters()]),
        "heals": stats.heals,
        "contributed": stats.contributed,
        "commits": stats.commits,
    }


def refused(m: Member) -> dict[str, Any]:
    """A member whose run ends in a refusal: returns the error's text instead of raising."""
    from distoptim.comm.guard import DesyncError

    try:
        return member(m)
    except DesyncError as exc:
        m.log("refused", error=f"{type(exc).__name__}: {exc}")
        return {"refused": f"{type(exc).__name__}: {exc}"}


def _pair_manager(
    replica_id: str,
    rank: int,
    lighthouse: str,
    store_port: int,
    quorum_timeout: float,
    connect_timeout: float,
) -> Any:
    """The stateless manager of process ``rank`` of the 2-process replica group ``replica_id``
    whose store listens on ``store_port``."""
    from distoptim.ft.replica import make_manager

    return make_manager(
        lighthouse,
        replica_id=replica_id,
        state_dict=lambda: {},
        load_state_dict=lambda _: None,
        rank=rank,
        world_size=2,
        store_addr="127.0.0.1",
        store_port=store_port,
        timeout=30,
        quorum_timeout=quorum_timeout,
        connect_timeout=connect_timeout,
        init_sync=False,
    )


def restarted_manager(rank: int, lighthouse: str, store_port: int) -> dict[str, Any]:
    """One process of a 2-process replica group restarted on its old store (as torchrun's
    ``--max-restarts`` does: ``TORCHELASTIC_RESTART_COUNT`` > 0, the dead incarnation's torchft
    keys still there). Rank 1 builds its manager first, then rank 0; both take one quorum."""
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    if rank == 0:
        store.wait(["rank1_building"])  # rank 1 asks for rank 0's address before it exists
    else:
        store.set("rank1_building", "1")
    manager = _pair_manager("restarted", rank, lighthouse, store_port, 60, connect_timeout=10)
    try:
        manager.start_quorum()
        manager.wait_quorum()
        return {"participants": manager.num_participants(), "errored": manager.errored()}
    finally:
        manager.shutdown(wait=False)


def rank0_lost(rank: int, lighthouse: str, store_port: int, how: str) -> dict[str, Any]:
    """One process of a 2-process replica group whose rank 0 dies (``how="kill"``: SIGKILL) or
    freezes (``"stop"``: SIGSTOP) after their first committed round; rank 1 then asks for its
    next quorum and returns what it raised (``error``) and how long it took (``waited``). Rank
    1 ends its frozen rank 0 by pid (as torchrun's agent ends a dead group's workers)."""
    from distoptim.ft.lighthouse import lighthouse_status
    from distoptim.ft.replicas import ManagedReplicas

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    # quorum_timeout above torchft's 80 s keep-alive: not what ends rank 1's wait
    manager = _pair_manager("lost", rank, lighthouse, store_port, 200, connect_timeout=5)
    replicas = ManagedReplicas(manager, "rank0_lost")
    replicas.quorum()
    assert replicas.commit()
    watch = manager._distoptim_watch  # what make_manager read of its group (rank 0: nothing)
    place = watch.group
    assert (place is None) == (rank == 0), place
    if rank == 0:
        store.wait(["rank1_asked"])
        store.set("rank0_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    # rank 0's live manager, as the lighthouse lists it (heartbeats every 0.1 s)
    heard = lighthouse_status(lighthouse).hears_from(place.replica)
    store.set("rank1_asked", "1")
    store.wait(["rank0_pid"])
    began = time.monotonic()
    try:
        replicas.start()
        replicas.quorum()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    waited = time.monotonic() - began
    if how == "stop":
        os.kill(int(store.get("rank0_pid")), signal.SIGKILL)
    manager.shutdown(wait=False)
    return {"error": error, "waited": waited, "heard": heard, "manager": place.manager}
