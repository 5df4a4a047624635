"""Fault-tolerant replica groups on one machine: a lighthouse, replica processes, and chaos.

Owns the local way to run a torchft job (what ``distoptim compare --fault-tolerant`` and the
tests use): a :class:`~distoptim.ft.lighthouse.Lighthouse` in this process, one process per
replica group (*slot*), and an optional :class:`Chaos` schedule that kills (SIGKILL) or stops
(SIGSTOP, then SIGCONT) one replica at a time, round robin over the slots, and restarts a
killed slot after a pause. Every replica process runs ``fn(ctx, *args)`` with a
:class:`ReplicaContext` (its slot, its incarnation, the lighthouse's address, an event log);
what the last incarnation of each slot returns comes back in :class:`ReplicaRun`.

Warm spares (``spares=N``): processes started with the replicas that import what a replica
needs and wait; a killed slot that restarts is handed to one of them (its next incarnation
runs there at once) and a new spare takes its place. Replica and spare processes get
``OMP_NUM_THREADS`` (``num_threads``) unless the user set it. A scenario may also stop the
run's lighthouse and start a new one on its address (:class:`Controls`).

Events. A replica appends one JSON line per event to its slot's log (``ctx.log("commit",
step=...)``); each line carries the wall-clock time. Lines survive a SIGKILL (each is flushed),
so a run's timeline -- starts, heals, commits, the chaos actions -- is complete afterwards
(:attr:`ReplicaRun.events`), which is what goodput and time-to-heal are computed from.

Failures. A replica killed by the chaos schedule is expected; any other failure of a replica
(an exception, an unexpected death) ends the run at once with
:class:`~distoptim.launch.RankFailedError` naming it, and every process is stopped. The whole
run is bounded by ``timeout``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distoptim import checks
from distoptim.ft.lighthouse import HeartbeatWatch, Lighthouse
from distoptim.launch import DEFAULT_TIMEOUT, ProcessOutcome, ProcessSupervisor, RankFailedError

__all__ = ["Chaos", "ChaosAction", "Controls", "ReplicaContext", "ReplicaRun", "run_replicas"]


@dataclass(frozen=True)
class Chaos:
    """A fault schedule: every ``every`` seconds one replica is killed or stopped.

    ``action``: ``"kill"`` (SIGKILL; the slot restarts ``pause`` seconds later, as a new
    process that heals from a peer) or ``"stop"`` (SIGSTOP; SIGCONT ``pause`` seconds later: the
    replica was frozen, its peers went on, it heals when it rejoins). The first fault comes
    ``every`` seconds after every replica passed its start line
    (:meth:`ReplicaContext.wait_for_peers`). Written ``kill:EVERY[:PAUSE]`` or
    ``stop:EVERY[:PAUSE]`` (:meth:`parse`; PAUSE defaults to 0 for kill, 5 for stop). One fault
    at a time: a period whose previous victim has not logged a ``commit`` since its fault (it
    is still restarting or healing) deals none, so a schedule faster than a restart never takes
    every replica down at once.

    ``by_step``: with it, the first fault comes at the latest when some replica logs a
    ``commit`` whose ``step`` reaches it (so a run shorter than ``every`` still meets a fault:
    the CLI sets a third of the run's steps); the later ones every ``every`` seconds.
    """

    action: str
    every: float
    pause: float
    by_step: int | None = None

    @classmethod
    def parse(cls, text: object) -> Chaos:
        """``Chaos`` from ``"kill:30"``, ``"kill:30:5"``, ``"stop:20:3"``; ValueError otherwise."""
        grammar = "kill:EVERY_S[:RESTART_S] or stop:EVERY_S[:CONT_S]"
        spec = checks.check_str("chaos", text)
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[0] not in ("kill", "stop"):
            raise ValueError(f"chaos must be {grammar}, got {spec!r}")
        try:
            numbers = [float(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(
                f"chaos must be {grammar} with numbers of seconds, got {spec!r}"
            ) from None
        every = checks.check_seconds("chaos EVERY_S", numbers[0])
        default_pause = 0.0 if parts[0] == "kill" else 5.0
        pause = numbers[1] if len(numbers) == 2 else default_pause
        pause = checks.check_seconds("chaos pause", pause, allow_zero=True)
        return cls(parts[0], every, pause)

    def __str__(self) -> str:
        return f"{self.action}:{self.every:g}:{self.pause:g}"


@dataclass(frozen=True)
class ChaosAction:
    """One fault the schedule dealt: ``action`` on ``slot`` (process ``pid``) at ``at`` (wall
    clock), and when the slot was restarted or continued (``resumed_at``, None if the run ended
    first)."""

    action: str
    slot: int
    pid: int
    at: float
    resumed_at: float | None = None


@dataclass(frozen=True)
class ReplicaContext:
    """What a replica process knows about its place in a local fault-tolerant run."""

    slot: int
    num_slots: int
    incarnation: int  # 0 for the first process of this slot, then 1, 2, ... after each kill
    lighthouse: str  # the lighthouse's address
    log_path: str  # this slot's event log (JSON lines)
    spawned_at: float  # wall clock when the parent started this process
    start_barrier: Any = None  # the first incarnations' start line (None for restarts)

    @property
    def replica_id(self) -> str:
        """The replica group's name (torchft's ``replica_id``): its slot as trailing digits."""
        return f"replica_{self.slot}"

    def wait_for_peers(self, timeout: float = 300.0) -> None:
        """The first incarnation of every slot waits here until all are ready to train.

        Processes start (and import torch) at different speeds; without a common start line
        the first one would train alone for its first steps. A restarted replica does not wait
        (it joins a running job). Raises ``TimeoutError`` naming the wait if some replica never
        arrives.
        """
        if self.start_barrier is None:
            return
        try:
            self.start_barrier.wait(timeout)
        except threading.BrokenBarrierError:
            raise TimeoutError(
                f"replica {self.slot}: not every replica of the run was ready to train within "
                f"{timeout:g} s (one failed or is still starting)"
            ) from None

    def finish_at(self) -> int | None:
        """The step a scenario asked every replica to stop at (``Controls.finish_at``), if any."""
        path = os.path.join(os.path.dirname(self.log_path), "FINISH_AT")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        return int(text) if text else None

    @property
    def _ending_path(self) -> str:
        return os.path.join(os.path.dirname(self.log_path), "ENDING")

    def ending(self) -> bool:
        """Has some replica of the run returned? A restarted replica that has not joined the
        others yet should then return too (there is nobody left to heal from)."""
        return os.path.exists(self._ending_path)

    def log(self, kind: str, **data: Any) -> None:
        """Append one event (``kind``, the wall clock, this incarnation, ``data``) to the log."""
        record = {"kind": kind, "t": time.time(), "slot": self.slot, "inc": self.incarnation}
        record.update(data)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


@dataclass
class ReplicaRun:
    """What a local fault-tolerant run did."""

    values: list[Any]  # per slot: what its last incarnation returned
    events: list[dict[str, Any]]  # every replica's events, by time
    chaos: list[ChaosAction] = field(default_factory=list)
    started_at: float = 0.0
    ended_at: float = 0.0
    # the lighthouse's view of the live groups' heartbeats (HeartbeatWatch.stop's figures):
    # the margin of its heartbeat_timeout against dropping a live but slow group
    heartbeats: dict[str, Any] = field(default_factory=dict)


def _replica_main(fn: Callable[..., Any], ctx: ReplicaContext, args: tuple[Any, ...]) -> Any:
    ctx.log("process", spawned_at=ctx.spawned_at)
    return _run_slot(fn, ctx, args)


def _run_slot(fn: Callable[..., Any], ctx: ReplicaContext, args: tuple[Any, ...]) -> Any:
    value = fn(ctx, *args)
    ctx.log("returned")
    with open(ctx._ending_path, "a", encoding="utf-8"):  # no more faults, no more joiners
        pass
    return value


def _spare_main(
    fn: Callable[..., Any], args: tuple[Any, ...], handoff: Any, ending_path: str
) -> Any:
    """A warm spare: imported and waiting; it runs ``fn`` for the slot it is handed, or
    returns None once the run is ending (no slot will need it)."""
    with contextlib.suppress(ImportError):  # what a replica's manager needs, loaded ahead
        import torchft  # noqa: F401

        import distoptim.ft.replica  # noqa: F401
    if os.path.exists(ending_path):  # a replacement spare started late in the run
        return None
    _warm_torch()
    warm_since = time.time()
    while True:
        if not handoff.empty():
            ctx = handoff.get()
            ctx.log("process", spawned_at=ctx.spawned_at, spare=True, warm_since=warm_since)
            return _run_slot(fn, ctx, args)
        if os.path.exists(ending_path):
            return None
        time.sleep(0.05)  # polls the hand-off queue and the run's end marker


def _warm_torch() -> None:
    """What torch loads lazily on a replica's first optimizer and step, loaded ahead: the first
    ``torch.optim`` optimizer built in a process imports ``torch._dynamo`` (some 800 modules,
    2.6 s on this 2-core machine), which a spare would otherwise pay after taking a slot."""
    with contextlib.suppress(ImportError):
        import torch

        param = torch.zeros(2, requires_grad=True)
        opt = torch.optim.Adam([param], lr=1e-3)
        torch.nn.functional.cross_entropy(
            param.view(1, 2), torch.zeros(1, dtype=torch.long)
        ).backward()
        opt.step()


class _Chaos(threading.Thread):
    """Deals the faults of a :class:`Chaos` schedule while the run lasts."""

    def __init__(self, run: _Run, chaos: Chaos) -> None:
        super().__init__(name="distoptim-chaos", daemon=True)
        self.run_state = run
        self.chaos = chaos
        self.done = threading.Event()
        self.actions: list[ChaosAction] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            try:  # the schedule's clock starts once every first incarnation is ready to train
                self.run_state.barrier.wait(self.run_state.start_timeout)
            except threading.BrokenBarrierError:
                return  # the run is failing at its start: the supervisor reports why
            victim = 0
            while not self._wait_period(first=victim == 0):
                if self.run_state.recovering():
                    continue  # one fault at a time: the last one has not healed yet
                slot = victim % self.run_state.num_slots
                victim += 1
                action = self.run_state.fault(slot, self.chaos.action)
                if action is None:
                    continue
                if self.done.wait(self.chaos.pause) or self.run_state.ending():
                    if action.action == "stop":  # a stopped process must not stay frozen
                        action = self.run_state.resume(action)
                    self.actions.append(action)  # a killed one stays down: the run is over
                    if self.done.is_set():
                        return
                    continue
                self.actions.append(self.run_state.resume(action))
        except BaseException as exc:  # surfaced by run_replicas
            self.error = exc

    def _wait_period(self, first: bool) -> bool:
        """Wait ``every`` seconds (the first period: or until a commit reaches ``by_step``);
        True when the run is over."""
        by_step = self.chaos.by_step
        if not first or by_step is None:
            return self.done.wait(self.chaos.every)
        deadline = time.monotonic() + self.chaos.every
        while time.monotonic() < deadline:
            if self.run_state.top_step() >= by_step:
                return self.done.is_set()
            if self.done.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
                return True
        return self.done.is_set()


class Controls:
    """What a scenario (``run_replicas(on_event=...)``) may do to the run's replicas.

    Every action is recorded in :attr:`ReplicaRun.chaos`. ``kill`` takes a slot down
    (SIGKILL); ``restart`` starts its next incarnation; ``stop``/``cont`` freeze and thaw its
    process (SIGSTOP/SIGCONT). Each returns False when the slot has no live process.
    ``stop_lighthouse``/``restart_lighthouse`` take the run's lighthouse down and bring a new
    one up on its address.
    """

    def __init__(self, run: _Run) -> None:
        self._run = run
        self._stopped: dict[int, ChaosAction] = {}
        self._killed: dict[int, ChaosAction] = {}
        self.actions: list[ChaosAction] = []
        self.history: list[dict[str, Any]] = []  # every event delivered so far

    def kill(self, slot: int) -> bool:
        action = self._run.fault(slot, "kill", force=True)
        if action is not None:
            self._killed[slot] = action
        return action is not None

    def restart(self, slot: int) -> None:
        action = self._killed.pop(slot, None) or ChaosAction("kill", slot, 0, time.time())
        self.actions.append(self._run.resume(action))

    def stop(self, slot: int) -> bool:
        action = self._run.fault(slot, "stop", force=True)
        if action is not None:
            self._stopped[slot] = action
        return action is not None

    def cont(self, slot: int) -> None:
        action = self._stopped.pop(slot, None)
        if action is not None:
            self.actions.append(self._run.resume(action))

    def finish_at(self, step: int) -> None:
        """Ask every replica to stop once it reaches ``step`` (:meth:`ReplicaContext.finish_at`)."""
        path = os.path.join(self._run.workdir, "FINISH_AT")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)  # atomic: a replica never reads half a number

    def seen(self, predicate: Callable[[dict[str, Any]], bool]) -> bool:
        """Whether some event delivered so far satisfies ``predicate``."""
        return any(predicate(e) for e in self.history)

    def stop_lighthouse(self) -> None:
        """Stop the run's lighthouse (its port stays reserved for :meth:`restart_lighthouse`)."""
        self._run.lighthouse.stop()

    def restart_lighthouse(self) -> None:
        """Start a new lighthouse on the stopped one's address (the replicas rejoin it)."""
        self._run.lighthouse.restart()

    def release(self) -> None:
        """Thaw every stopped process (the scenario is over)."""
        for slot in list(self._stopped):
            self.cont(slot)
        self.actions += list(self._killed.values())


class _Watcher(threading.Thread):
    """Feeds every new event of the slots' logs to a scenario, in time order per poll."""

    def __init__(self, run: _Run, on_event: Callable[[dict[str, Any], Controls], None]) -> None:
        super().__init__(name="distoptim-scenario", daemon=True)
        self.run_state = run
        self.on_event = on_event
        self.controls = Controls(run)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._offsets = [0] * run.num_slots

    def _new_events(self) -> list[dict[str, Any]]:
        events = []
        for slot in range(self.run_state.num_slots):
            path = self.run_state.log_path(slot)
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as f:
                f.seek(self._offsets[slot])
                data = f.read()
            end = data.rfind("\n") + 1  # a line still being written waits for the next poll
            self._offsets[slot] += len(data[:end].encode("utf-8"))
            for line in data[:end].splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    events.append(json.loads(line))
        return sorted(events, key=lambda e: e["t"])

    def run(self) -> None:
        try:
            while not self.done.wait(0.05):  # the logs are files: read what was appended
                for event in self._new_events():
                    self.controls.history.append(event)
                    self.on_event(event, self.controls)
        except BaseException as exc:  # surfaced by run_replicas, after the run
            self.error = exc
        finally:
            self.controls.release()


class _LocalLighthouse:
    """The run's lighthouse, which a scenario may stop and restart on the same port."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._server: Lighthouse | None = Lighthouse(**options)
        self.address, self.port = self._server.address, self._server.port

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def restart(self) -> None:
        self.stop()
        self._server = Lighthouse(**{**self._options, "port": self.port})

    def __enter__(self) -> _LocalLighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Run:
    """The parent's bookkeeping of one local run (slots, their processes, expected deaths)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        num_slots: int,
        address: str,
        workdir: str,
        supervisor: ProcessSupervisor,
        chaos: bool,
        start_timeout: float,
    ) -> None:
        self.fn = fn
        self.args = args
        self.num_slots = num_slots
        self.address = address
        self.workdir = workdir
        self.supervisor = supervisor
        self.lock = threading.Lock()
        self.index_of: list[int] = []  # slot -> supervisor index of its current process
        self.incarnations = [0] * num_slots
        self.expected: set[int] = set()  # supervisor indices whose death the chaos caused
        self.faulted: set[int] = set()  # slots faulted that have not committed since
        self.fault_times: dict[int, float] = {}
        # the replicas' start line; with chaos the schedule's clock waits on it too
        self.barrier = multiprocessing.get_context("spawn").Barrier(num_slots + int(chaos))
        self.start_timeout = start_timeout
        self.lighthouse: Any = None  # the run's _LocalLighthouse
        self._read_to: dict[int, int] = {}  # top_step(): bytes of each log read so far
        self.spares: list[tuple[int, Any]] = []  # waiting spares: (process index, hand-off)
        self.spare_indices: list[int] = []  # every spare ever started
        self._top_step = -1

    @property
    def _ending_path(self) -> str:
        return os.path.join(self.workdir, "ENDING")

    def log_path(self, slot: int) -> str:
        return os.path.join(self.workdir, f"replica_{slot}.jsonl")

    def _env(self) -> dict[str, str]:
        """``OMP_NUM_THREADS`` for a replica process (unless the user set it): OpenMP reads it
        as torch loads, before ``torch.set_num_threads`` can act. On a machine with fewer cores
        than replicas, one thread per group ran 300 steps in 14 s; every core per group, 135 s."""
        threads = self.supervisor.num_threads
        if threads is None or "OMP_NUM_THREADS" in os.environ:
            return {}
        return {"OMP_NUM_THREADS": str(threads)}

    def start_spare(self) -> None:
        """Start a warm spare: a process that imports what a replica needs, then waits."""
        handoff = multiprocessing.get_context("spawn").SimpleQueue()
        index = self.supervisor.add(
            _spare_main,
            (self.fn, self.args, handoff, self._ending_path),
            name=f"spare {len(self.spare_indices)}",
            env=self._env(),
            critical=False,
        )
        with self.lock:
            self.spare_indices.append(index)
            self.spares.append((index, handoff))

    def start(self, slot: int) -> None:
        ctx = ReplicaContext(
            slot,
            self.num_slots,
            self.incarnations[slot],
            self.address,
            self.log_path(slot),
            time.time(),
            self.barrier if self.incarnations[slot] == 0 else None,
        )
        spare = None
        with self.lock:
            if ctx.incarnation and self.spares and not self.ending():
                spare = self.spares.pop(0)
        if spare is not None:  # a warm process takes the slot; a new spare replaces it
            index, handoff = spare
            handoff.put(ctx)
            self.start_spare()
        else:
            index = self.supervisor.add(
                _replica_main,
                (self.fn, ctx, self.args),
                name=f"replica {slot}"
                + (f" (restart {ctx.incarnation})" if ctx.incarnation else ""),
                env=self._env(),
                critical=False,
            )
        with self.lock:
            if slot < len(self.index_of):
                self.index_of[slot] = index
            else:
                self.index_of.append(index)

    def top_step(self) -> int:
        """The highest ``step`` any replica's ``commit`` event carries so far (-1: none)."""
        for slot in range(self.num_slots):
            path = self.log_path(slot)
            with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
                f.seek(self._read_to.get(slot, 0))
                data = f.read()
                end = data.rfind("\n") + 1
                self._read_to[slot] = self._read_to.get(slot, 0) + len(data[:end].encode())
                for line in data[:end].splitlines():
                    with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                        event = json.loads(line)
                        if event["kind"] == "commit" and "step" in event:
                            self._top_step = max(self._top_step, int(event["step"]))
        return self._top_step

    def recovering(self) -> bool:
        """Has a slot the chaos faulted not logged a ``commit`` since (it is still healing)?"""
        for slot in list(self.faulted):
            path = self.log_path(slot)
            with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
            faulted_at = self.fault_times.get(slot, 0.0)
            for line in reversed(lines):
                with contextlib.suppress(json.JSONDecodeError):
                    event = json.loads(line)
                    if event["kind"] == "commit" and event["t"] > faulted_at:
                        self.faulted.discard(slot)
                        break
        return bool(self.faulted)

    def ending(self) -> bool:
        """Has some replica returned (so the run is ending and no fault must be dealt)?"""
        return os.path.exists(os.path.join(self.workdir, "ENDING"))

    def fault(self, slot: int, action: str, force: bool = False) -> ChaosAction | None:
        """Kill or stop ``slot``'s process (None once the run is ending -- unless ``force`` --
        or when it is gone)."""
        if self.ending() and not force:
            return None
        with self.lock:
            index = self.index_of[slot]
            pid = self.supervisor.pid(index)
            if pid is None:
                return None
            if action == "kill":
                self.expected.add(index)
        try:
            os.kill(pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            return None
        now = time.time()
        with self.lock:
            self.faulted.add(slot)
            self.fault_times[slot] = now
        return ChaosAction(action, slot, pid, now)

    def resume(self, action: ChaosAction) -> ChaosAction:
        """Restart a killed slot, or continue a stopped process."""
        if action.action == "stop":
            with contextlib.suppress(ProcessLookupError):
                os.kill(action.pid, signal.SIGCONT)
        else:
            with self.lock:
                self.incarnations[action.slot] += 1
            self.start(action.slot)
        return ChaosAction(action.action, action.slot, action.pid, action.at, time.time())

    def on_failure(self, outcome: ProcessOutcome) -> None:
        """A replica process failed: expected (the chaos killed it) or the end of the run."""
        with self.lock:
            if outcome.index in self.expected:
                return
        self.barrier.abort()  # peers still at the start line must not wait for this one
        raise RankFailedError(outcome.index, outcome.name, outcome.headline(), outcome.error, [])


def run_replicas(
    fn: Callable[..., Any],
    num_replicas: int,
    *,
    args: Sequence[Any] = (),
    min_replicas: int = 1,
    chaos: Chaos | None = None,
    on_event: Callable[[dict[str, Any], Controls], None] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    heartbeat_timeout: float = 1.0,
    join_timeout: float = 10.0,
    num_threads: int | None = 1,
    workdir: str | None = None,
    spares: int = 0,
) -> ReplicaRun:
    """Run ``fn(ctx, *args)`` in ``num_replicas`` replica processes around a local lighthouse.

    ``fn`` must be picklable (a module-level function) and build its own ``torchft.Manager``
    with ``ctx.lighthouse`` and ``ctx.replica_id`` (:func:`distoptim.ft.replica.make_manager`
    does). ``chaos``: the fault schedule (needs ``num_replicas >= 2``). ``on_event(event,
    controls)``: a scenario, called (from a thread of this process) with every event the
    replicas log, in time order, that may act on them (:class:`Controls`): faults triggered
    by what happens, not by the clock. ``heartbeat_timeout``,
    ``join_timeout``: the lighthouse's (seconds). ``num_threads``: torch threads per replica
    process (and its ``OMP_NUM_THREADS`` unless set; None: torch's default). ``workdir``: where
    the event logs go (a
    temporary folder, removed afterwards, when None). ``spares``: warm spares -- processes
    started with the replicas, imported and waiting; a killed slot that restarts is handed to
    one at once (it logs ``process`` with ``spare=True`` and ``warm_since``, when it was ready)
    and a new spare is started in its place, so recovery costs the heal, not a process start
    and an import. Spares left over return when the run ends. Raises
    :class:`~distoptim.launch.RankFailedError` for a replica that failed on its own and
    :class:`~distoptim.launch.ProcessTimeoutError` after ``timeout`` seconds.
    """
    num_replicas = checks.check_int("num_replicas", num_replicas, 1)
    min_replicas = checks.check_int("min_replicas", min_replicas, 1)
    spares = checks.check_int("spares", spares, 0)
    if chaos is not None and not isinstance(chaos, Chaos):
        raise TypeError(f"chaos must be a Chaos (Chaos.parse('kill:30')), got {chaos!r}")
    if chaos is not None and num_replicas < 2:
        raise ValueError("chaos needs at least 2 replicas: someone must survive each fault")
    if min_replicas > num_replicas:
        raise ValueError(
            f"min_replicas={min_replicas} is more than the {num_replicas} replicas started: "
            "no quorum could ever form"
        )
    holder = contextlib.ExitStack()
    with holder:
        if workdir is None:
            workdir = holder.enter_context(tempfile.TemporaryDirectory(prefix="distoptim-ft-"))
        lighthouse = holder.enter_context(
            _LocalLighthouse(
                min_replicas=min_replicas,
                heartbeat_timeout=heartbeat_timeout,
                join_timeout=join_timeout,
            )
        )
        run: _Run | None = None
        supervisor = ProcessSupervisor(
            timeout=timeout,
            num_threads=num_threads,
            on_failure=lambda outcome: run.on_failure(outcome),  # type: ignore[union-attr]
        )
        run = _Run(
            fn,
            tuple(args),
            num_replicas,
            lighthouse.address,
            workdir,
            supervisor,
            chaos is not None,
            timeout,
        )
        run.lighthouse = lighthouse
        started = time.time()
        dealer = _Chaos(run, chaos) if chaos is not None else None
        watcher = _Watcher(run, on_event) if on_event is not None else None
        beats = HeartbeatWatch(lighthouse.address)
        beats.start()
        try:
            for slot in range(num_replicas):
                run.start(slot)
            for _ in range(spares):
                run.start_spare()
            for thread in (dealer, watcher):
                if thread is not None:
                    thread.start()
            outcomes = supervisor.run()
        finally:
            for thread in (dealer, watcher):
                if thread is not None:
                    thread.done.set()
                    thread.join(timeout=60)
            supervisor.close()
            heartbeats = beats.stop()
        for thread in (dealer, watcher):
            if thread is not None and thread.error is not None:
                raise thread.error
        values: list[Any] = [None] * num_replicas
        for slot, index in enumerate(run.index_of):
            values[slot] = outcomes[index].value
        events = _read_events(workdir, num_replicas)
        actions = (dealer.actions if dealer else []) + (watcher.controls.actions if watcher else [])
        return ReplicaRun(values, events, actions, started, time.time(), heartbeats)


def _read_events(workdir: str, num_slots: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for slot in range(num_slots):
        path = os.path.join(workdir, f"replica_{slot}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by a SIGKILL
                    events.append(json.loads(line))
    events.sort(key=lambda e: e["t"])
    return events
