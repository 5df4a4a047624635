"""Healing torchft replica groups of several processes: a whole group killed and restarted.

Real processes around a real lighthouse (in this process): replica groups of 2 processes each,
every group its own gloo world with FSDP2 inside (``tests/ft/group_workloads.py``), one
``torchft.Manager`` per process (the group's ``replica_id``, its group rank), DiLoCo across the
groups -- or ``CrossShardOptimizer(manager=)``, each process averaging its shard's gradient with
its counterparts' at every step (HSDP, the replicate dimension torchft's). The victim group's
two processes stop themselves at a named point of a sync's round (``after_quorum``,
:mod:`distoptim.ft.inject`); the test kills both by pid, lets the survivors commit without them,
and starts the group again. Each restarted process must heal from its counterpart (the same
group rank in a surviving group), contribute again, and end -- as every process of every group
-- with the same shards, bit for bit, as its counterparts.

With one process of the group killed instead, the other must fail by itself, naming its group
rank (a group that lost a process is a group that died), before it is killed too. Also: a group
whose processes differ from one another (one rank's shard perturbed) is refused on both its
processes while the other groups go on; and a group restarted on its old store (torchrun's
``--max-restarts``) does not reach its dead incarnation's manager address; and a rank whose
group's rank 0 (the group's torchft manager) is killed or frozen names its group rank and the
cause within seconds.

Every wait is bounded and driven by what the processes log, never by a sleep; the end of the
run is decided inside the processes from what they all see alike (``group_workloads``).
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
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from distoptim.ft.lighthouse import Lighthouse
from distoptim.launch import ProcessOutcome, ProcessSupervisor, RankFailedError
from tests.ft import group_workloads
from tests.ft.group_workloads import Member

pytestmark = [pytest.mark.slow, pytest.mark.timeout(540)]  # bounded inside, RUN_TIMEOUT

SIZE = 2  # processes per replica group
RUN_TIMEOUT = 420  # seconds: a bound on a hung run (it takes well under a minute alone)
WAIT = 300  # seconds: a bound on each wait for what the processes log
KILL_AT = "after_quorum:contributor@3"  # the victim group stops in its third sync's round


class GroupRun:
    """Replica groups of :data:`SIZE` processes around one lighthouse, supervised.

    Each group incarnation gets a TCPStore hosted here (its processes' gloo world and their
    managers' store), so a restarted group starts on a fresh one. A process killed by
    :meth:`kill_group` is expected to die; any other failure ends the run, naming it.
    """

    def __init__(self, workdir: str, groups: int, fn: Callable[[Member], Any]) -> None:
        self.workdir, self.groups, self.fn = workdir, groups, fn
        self.lighthouse = Lighthouse(min_replicas=1, heartbeat_timeout=2, join_timeout=60)
        self.supervisor = ProcessSupervisor(
            timeout=RUN_TIMEOUT, num_threads=1, on_failure=self._failed
        )
        self.barrier = multiprocessing.get_context("spawn").Barrier(groups * SIZE)
        self.stores: list[Any] = []
        self.index: dict[tuple[int, int, int], int] = {}  # (group, rank, inc) -> process
        self.expected: set[int] = set()
        self.outcomes: list[ProcessOutcome] | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _failed(self, outcome: ProcessOutcome) -> None:
        if outcome.index not in self.expected:
            raise RankFailedError(
                outcome.index, outcome.name, outcome.headline(), outcome.error, []
            )

    def log_path(self, group: int, rank: int, inc: int) -> str:
        return os.path.join(self.workdir, f"group{group}_rank{rank}_inc{inc}.jsonl")

    def start_group(
        self,
        group: int,
        inc: int,
        faults: dict[int, str] | None = None,
        perturb: frozenset[int] = frozenset(),
        end_at_sync: int = 0,
        algorithm: str = "diloco",
    ) -> None:
        """Start the group's processes (``faults``: an inject spec per rank; ``perturb``: the
        ranks whose shard goes off)."""
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.stores.append(store)
        for rank in range(SIZE):
            member = Member(
                group,
                rank,
                SIZE,
                self.groups,
                inc,
                self.lighthouse.address,
                store.port,
                self.log_path(group, rank, inc),
                (faults or {}).get(rank, ""),
                rank in perturb,
                end_at_sync,
                self.barrier if inc == 0 else None,
                algorithm,
            )
            self.index[group, rank, inc] = self.supervisor.add(
                self.fn,
                (member,),
                name=f"group {group} rank {rank}" + (f" (restart {inc})" if inc else ""),
                env={"OMP_NUM_THREADS": "1"},
                critical=False,
            )

    def run_in_background(self) -> None:
        def run() -> None:
            try:
                self.outcomes = self.supervisor.run()
            except BaseException as exc:  # surfaced by wait_for / join
                self.error = exc

        self._thread = threading.Thread(target=run, name="group-heal-supervisor", daemon=True)
        self._thread.start()

    def expect_death(self, group: int, inc: int) -> None:
        """The group's processes are about to die (killed, or failing because a peer was)."""
        self.expected.update(self.index[group, rank, inc] for rank in range(SIZE))

    def kill(self, group: int, inc: int, ranks: list[int]) -> list[int]:
        """SIGKILL those processes of the group (by pid: processes this test started); a
        process that has exited already is skipped."""
        self.expect_death(group, inc)
        pids = []
        for rank in ranks:
            pid = self.supervisor.pid(self.index[group, rank, inc])
            assert pid is not None, (group, rank, inc)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                pids.append(pid)
        return pids

    def events(self) -> list[dict[str, Any]]:
        out = []
        for name in sorted(os.listdir(self.workdir)):
            if not name.endswith(".jsonl"):
                continue
            with open(os.path.join(self.workdir, name), encoding="utf-8") as f:
                for line in f:
                    with contextlib.suppress(json.JSONDecodeError):  # a line cut by a SIGKILL
                        out.append(json.loads(line))
        return sorted(out, key=lambda e: e["t"])

    def wait_for(self, what: str, predicate: Callable[[list[dict[str, Any]]], bool]) -> None:
        """Until ``predicate(events)`` holds; fails naming ``what`` after :data:`WAIT` seconds
        or as soon as the run fails."""
        deadline = time.monotonic() + WAIT
        while not predicate(self.events()):
            if self.error is not None:
                raise self.error
            if self._thread is not None and not self._thread.is_alive():
                raise AssertionError(f"the run ended before {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {WAIT} s: {what}")
            time.sleep(0.05)  # polls the processes' logs (files), not a synchronisation

    def join(self) -> list[ProcessOutcome]:
        assert self._thread is not None
        self._thread.join(RUN_TIMEOUT + 60)
        if self.error is not None:
            raise self.error
        assert self.outcomes is not None, "the supervisor did not end"
        return self.outcomes

    def value(self, group: int, rank: int, inc: int) -> Any:
        assert self.outcomes is not None
        return self.outcomes[self.index[group, rank, inc]].value

    def close(self) -> None:
        self.supervisor.close()  # kills what is still running (idempotent)
        if self._thread is not None:
            self._thread.join(60)
        self.lighthouse.close()
        self.stores.clear()


@contextlib.contextmanager
def _group_run(groups: int, fn: Callable[[Member], Any]) -> Any:
    with tempfile.TemporaryDirectory(prefix="distoptim-groupheal-") as workdir:
        run = GroupRun(workdir, groups, fn)
        try:
            yield run
        finally:
            run.close()


def _of(events: list[dict[str, Any]], kind: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind and all(e[k] == v for k, v in match.items())]


SCENARIOS = {  # id: (replica groups, the victim group's ranks that stop at KILL_AT and die,
    # what runs across the groups: DiLoCo, or CrossShardOptimizer(manager=) at every step)
    "3groups-whole-group-killed": (3, [0, 1], "diloco"),
    "2groups-one-process-killed": (2, [1], "diloco"),
    "3groups-whole-group-killed-cross-shard": (3, [0, 1], "cross_shard"),
}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def healed(request) -> dict[str, Any]:
    """The last group's ``stopped`` ranks stop at its third sync's quorum and are killed; with
    one process killed, the other must fail on its own (a group that lost a process is dead)
    and is then killed too, as torchrun's agent does; the group restarts; all run on."""
    groups, stopped, algorithm = SCENARIOS[request.param]
    victim = groups - 1
    with _group_run(groups, group_workloads.member) as run:
        for g in range(groups):
            faults = {r: KILL_AT for r in stopped} if g == victim else None
            run.start_group(g, 0, faults=faults, algorithm=algorithm)
        run.run_in_background()
        run.wait_for(
            f"ranks {stopped} of group {victim} stopped at after_quorum",
            lambda ev: len(_of(ev, "inject", group=victim)) == len(stopped),
        )
        killed_at = time.time()
        pids = run.kill(victim, 0, stopped)
        left = [r for r in range(SIZE) if r not in stopped]
        run.wait_for(
            f"ranks {left} of group {victim} failed once it lost a process",
            lambda ev: len(_of(ev, "failed", group=victim, inc=0)) == len(left),
        )
        pids += run.kill(victim, 0, left)  # what is left of the group, as torchrun's agent
        survivors = {(g, r) for g in range(groups) if g != victim for r in range(SIZE)}
        run.wait_for(  # every survivor process: their logs of one commit come at their own pace
            "every survivor process committed a sync without the dead group",
            lambda ev: (
                survivors
                <= {
                    (e["group"], e["rank"])
                    for e in _of(ev, "commit")
                    if e["group"] != victim and e["participants"] < groups and e["t"] > killed_at
                }
            ),
        )
        restarted_at = time.time()
        run.start_group(victim, 1, algorithm=algorithm)
        run.join()
        values = {
            (g, r, inc): run.value(g, r, inc)
            for (g, r, inc) in run.index
            if not (g == victim and inc == 0)
        }
        return {
            "groups": groups,
            "victim": victim,
            "stopped": stopped,
            "pids": pids,
            "killed_at": killed_at,
            "restarted_at": restarted_at,
            "events": run.events(),
            "values": values,
        }


def test_the_victim_processes_stopped_at_the_same_round(healed):
    stops = _of(healed["events"], "inject", group=healed["victim"])
    assert sorted(e["rank"] for e in stops) == healed["stopped"]
    assert len({(e["point"], e["role"], e["syncs"], e["step"]) for e in stops}) == 1, stops
    assert stops[0]["point"] == "after_quorum" and stops[0]["role"] == "contributor"


def test_a_group_that_loses_a_process_dies_whole(healed):
    """The processes not killed fail by themselves, naming the cause, before the restart."""
    victim, events = healed["victim"], healed["events"]
    for rank in range(SIZE):
        if rank in healed["stopped"]:
            assert not _of(events, "failed", group=victim, rank=rank, inc=0)
            continue
        (failed,) = _of(events, "failed", group=victim, rank=rank, inc=0)
        assert failed["t"] < healed["restarted_at"], failed
        # in its first collective after the quorum, inside the group, naming its group rank
        says = failed["error"]
        assert says.startswith(f"DesyncError: DiLoCo: rank {rank} of its replica group"), says
        assert "another process of this replica group died or stopped" in says, says
        commits = _of(events, "commit", group=victim, rank=rank, inc=0)
        stop = _of(events, "inject", group=victim)[0]
        assert all(e["syncs"] <= stop["syncs"] for e in commits), commits  # nothing after it


def test_every_process_of_the_restarted_group_heals_from_its_counterpart(healed):
    victim, events = healed["victim"], healed["events"]
    for rank in range(SIZE):
        loads = _of(events, "loading", group=victim, rank=rank, inc=1)
        assert loads, f"rank {rank} of the restarted group never loaded a peer's state"
        for e in loads:
            assert e["from_rank"] == rank, e  # its counterpart, not another shard's holder
            assert e["from_group"] != victim, e
            assert e["got"] == e["sent"], e  # it holds, bitwise, what the donor sent
            served = _of(events, "serving", group=e["from_group"], rank=rank)
            assert any(s["sent"] == e["sent"] for s in served), (e, served)
        assert healed["values"][victim, rank, 1]["heals"] >= 1


def test_no_donor_reads_its_state_while_its_forward_or_backward_runs(healed):
    """A donor's state is read by torchft's quorum thread; with CrossShard the quorum forms
    beside the forward and backward passes, and an FSDP2 module's state_dict() there reshards
    it under its own backward (``setStorage ... storage of size 0``). The round holds those
    reads until step() waits for the quorum (ManagedReplicas.start)."""
    served = _of(healed["events"], "serving")
    assert served, "no donor served a healing process"
    assert not [e for e in served if e["in_pass"]], served


def test_every_process_ends_bitwise_equal_to_its_counterparts(healed):
    values, groups = healed["values"], healed["groups"]
    for rank in range(SIZE):
        mine = [values[g, rank, 1 if g == healed["victim"] else 0] for g in range(groups)]
        for key in ("state", "model", "step", "syncs"):
            assert len({v[key] for v in mine}) == 1, (rank, key, mine)
    # the shards of one group differ (the comparison above is not of equal halves), and every
    # process of every group gathers the same whole model
    finals = list(values.values())
    assert len({values[0, r, 0]["state"] for r in range(SIZE)}) == SIZE
    assert len({v["whole"] for v in finals}) == 1


def test_at_every_commit_counterparts_hold_the_same_shards(healed):
    by: dict[tuple[int, int], set[int]] = defaultdict(set)
    for e in _of(healed["events"], "commit"):
        by[e["rank"], e["syncs"]].add(e["state"])
    bad = {k: v for k, v in by.items() if len(v) > 1}
    assert not bad, f"counterparts committed different shards at (rank, sync) {sorted(bad)[:5]}"


def test_the_survivors_never_stopped(healed):
    victim, events = healed["victim"], healed["events"]
    for g in range(healed["groups"]):
        if g == victim:
            continue
        for rank in range(SIZE):
            mine = _of(events, "commit", group=g, rank=rank)
            assert {e["inc"] for e in mine} == {0}  # one process throughout
            assert healed["values"][g, rank, 0]["heals"] == 0  # it never took a peer's state
            syncs = [e["syncs"] for e in mine]
            assert syncs == list(range(1, len(syncs) + 1)), syncs  # every sync committed in turn
            alone = [
                e
                for e in mine
                if healed["killed_at"] < e["t"] < healed["restarted_at"]
                and e["participants"] < healed["groups"]
            ]
            assert alone, f"group {g} rank {rank} committed nothing while the victim was dead"


def test_the_restarted_group_contributes_again(healed):
    victim, events = healed["victim"], healed["events"]
    for rank in range(SIZE):
        assert healed["values"][victim, rank, 1]["contributed"] >= 1
        last = _of(events, "commit", group=victim, rank=rank, inc=1)[-1]
        assert last["contributed"] and last["participants"] == healed["groups"], last


# ---- a group whose processes differ from one another ---------------------------------------
ODD, END = 1, 6  # the group whose rank 1 perturbs its shard after sync 2; syncs to run


@pytest.fixture(scope="module")
def differing() -> dict[str, Any]:
    """3 groups; rank 1 of group 1 adds 1e-3 to its shard of the global copy after sync 2."""
    groups = 3
    with _group_run(groups, group_workloads.refused) as run:
        for g in range(groups):
            run.start_group(
                g, 0, perturb=frozenset({1}) if g == ODD else frozenset(), end_at_sync=END
            )
        run.run_in_background()
        run.join()
        values = {key: run.value(*key) for key in run.index}
        return {"groups": groups, "events": run.events(), "values": values}


def test_a_group_whose_processes_differ_is_refused_by_name_on_both_its_processes(differing):
    for rank in range(SIZE):  # both: its rank 0 matches its counterparts, yet it is refused
        says = differing["values"][ODD, rank, 0].get("refused", "no error")
        assert says.startswith("ParameterMismatchError"), (rank, says)
        assert "state checksum" in says, (rank, says)
        assert "is refused before it contributes" in says, (rank, says)


def test_the_other_groups_go_on_without_it_and_stay_bitwise_equal(differing):
    values = differing["values"]
    others = [g for g in range(differing["groups"]) if g != ODD]
    for rank in range(SIZE):
        mine = [values[g, rank, 0] for g in others]
        assert all("refused" not in v for v in mine), mine
        assert {v["syncs"] for v in mine} == {END}
        assert len({v["state"] for v in mine}) == 1, (rank, mine)
        assert len({v["model"] for v in mine}) == 1, (rank, mine)
        late = [e for e in _of(differing["events"], "commit", rank=rank) if e["syncs"] > 2]
        assert late and all(e["group"] != ODD for e in late), late  # nothing after the fault
        assert all(e["participants"] == len(others) for e in late), late


# ---- torchrun's restart of a group on its old store ------------------------------------------
def test_a_group_restarted_on_its_old_store_does_not_reach_its_dead_managers_address():
    """The group's store still holds the dead incarnation's torchft keys (a manager address
    nobody serves); both processes of the restarted group build their managers on it, rank 1
    first, and take a quorum together."""
    from distoptim.ft import _torchft

    assert _torchft.group_store_keys() == ("manager_addr", "replica_id")  # torchft 0.2.0's
    stale = "http://127.0.0.1:1"
    with Lighthouse(min_replicas=1) as lighthouse:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store.set("manager_addr", stale)
        store.set("replica_id", "restarted:dead-incarnation")
        supervisor = ProcessSupervisor(timeout=240, num_threads=1)
        try:
            for rank in range(SIZE):
                supervisor.add(
                    group_workloads.restarted_manager,
                    (rank, lighthouse.address, store.port),
                    name=f"restarted rank {rank}",
                    env={"OMP_NUM_THREADS": "1", "TORCHELASTIC_RESTART_COUNT": "1"},
                )
            outcomes = supervisor.run()
        finally:
            supervisor.close()
        assert store.get("manager_addr").decode() != stale
    for rank, outcome in enumerate(outcomes):
        assert outcome.value == {"participants": 1, "errored": None}, (rank, outcome)


# ---- a group whose rank 0 dies or freezes while its rank 1 waits for a quorum ------------------
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_whose_group_manager_is_lost_names_its_group_rank_within_seconds(how):
    """Rank 0's process hosts the group's torchft manager; rank 1 asks it for every quorum.
    Killed, rank 1's next quorum fails at once; frozen, torchft's client would wait for its
    HTTP/2 keep-alive (80 s) and say ``http2 error``: rank 1 names its group rank and the cause
    within connect_timeout (5 s here) of the lighthouse no longer hearing from the group
    (heartbeat_timeout, 2 s here)."""
    with Lighthouse(min_replicas=1, heartbeat_timeout=2) as lighthouse:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        supervisor = ProcessSupervisor(timeout=240, num_threads=1)
        try:
            for rank in range(SIZE):
                supervisor.add(
                    group_workloads.rank0_lost,
                    (rank, lighthouse.address, store.port, how),
                    name=f"rank {rank}",
                    env={"OMP_NUM_THREADS": "1"},
                    critical=False,
                )
            rank0, rank1 = supervisor.run()
        finally:
            supervisor.close()
    assert rank0.exitcode == -signal.SIGKILL, rank0  # by itself, or by rank 1 (frozen)
    says, waited = rank1.value["error"], rank1.value["waited"]
    assert rank1.value["heard"] is True, rank1  # the lighthouse lists rank 0's live manager
    assert says is not None, rank1
    assert says.startswith(
        "GroupManagerUnreachableError: replica 'lost', rank 1 of its 2 processes: its group's "
        f"rank 0 manager at {rank1.value['manager']} "
    ), says
    assert "Rank 0 of this replica group died or stopped" in says, says
    if how == "stop":  # torchft's own error comes only with its keep-alive
        assert "no heartbeat within its heartbeat timeout" in says and waited < 80, (waited, says)
