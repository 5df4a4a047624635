"""distoptim.launch: return values, errors with tracebacks, hangs and deaths end within timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distoptim.launch import (
    RESTART_COUNT_ENV,
    PeerFailureError,
    ProcessOutcome,
    ProcessSupervisor,
    ProcessTimeoutError,
    RankFailedError,
    _with_process_group,
    is_peer_failure,
    root_cause,
    run_processes,
    spawn,
    torchrun_env,
    torchrun_main,
)

pytestmark = pytest.mark.timeout(120)


def _sum_ranks(rank: int, world_size: int, scale: float) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world": world_size,
        "sum": t * scale,
        "env_rank": os.environ["RANK"],
        "initialized": dist.is_initialized(),
    }


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        threading_event_that_never_fires()
    return rank


def threading_event_that_never_fires() -> None:
    import threading

    threading.Event().wait()


def _exit_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    dist.barrier()  # rank 1 would wait forever for rank 0: must be killed, not orphaned
    return rank


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _echo(x: int) -> int:
    if x < 0:
        os._exit(7)
    return x * 2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is not running
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_spawn_returns_values_in_rank_order_and_tensors_travel():
    out = spawn(_sum_ranks, 2, args=(10.0,), timeout=60)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 and o["initialized"] for o in out)
    assert [o["env_rank"] for o in out] == ["0", "1"]
    assert all(torch.equal(o["sum"], torch.tensor([10.0])) for o in out)


def _raise_between_collectives(rank: int, world_size: int) -> int:
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        raise ValueError("the real cause, from rank one")
    dist.all_reduce(t)  # rank 0 waits here until rank 1's group is gone: a consequence
    return rank


def test_real_cause_between_collectives_beats_the_peers_gloo_error():
    """Rank 1 raises between collectives; rank 0 then fails in gloo. Three trials in two runs:
    two pairs side by side without fail-fast (both reports inspected), then one spawn."""
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in "ab"]
    outcomes = run_processes(
        _with_process_group,
        [(_raise_between_collectives, "gloo", 30.0, ())] * 4,
        envs=[torchrun_env(r, 2, s.port) for s in stores for r in range(2)],
        fail_fast=False,
        num_threads=1,
        timeout=60,
    )
    for pair in (outcomes[:2], outcomes[2:]):
        first, second = pair
        assert second.raised and not second.secondary
        assert isinstance(second.exception, ValueError)
        assert first.raised and first.secondary, first.error  # gloo: connection closed by peer
        assert second.failed_at <= first.failed_at  # reported before the group was torn down
        assert root_cause(pair) is second
    with pytest.raises(RankFailedError, match="the real cause") as info:
        spawn(_raise_between_collectives, 2, timeout=60, num_threads=1)
    assert info.value.rank == 1 and isinstance(info.value.__cause__, ValueError)
    assert all(o.index == 0 and o.secondary for o in info.value.others)


def test_root_cause_order_and_peer_failure_classification():
    assert is_peer_failure(RuntimeError("[pair.cc:553] Connection closed by peer [1.2.3.4]:5"))
    assert is_peer_failure(PeerFailureError("shard gone"))
    assert is_peer_failure(dist.DistNetworkError("x"))
    assert not is_peer_failure(ValueError("Connection closed by peer"))  # user code's own error
    assert not is_peer_failure(RuntimeError("shape mismatch"))

    def out(i, raised, secondary, at):
        return ProcessOutcome(
            i, f"rank {i}", False, raised=raised, secondary=secondary, failed_at=at
        )

    consequence, death, late_user, user = (
        out(0, True, True, 1.0),
        out(1, False, False, 2.0),
        out(2, True, False, 5.0),
        out(3, True, False, 4.0),
    )
    assert root_cause([consequence, death, late_user, user]) is user
    assert root_cause([consequence, death]) is death
    assert root_cause([consequence, out(4, True, True, 0.5)]).index == 4
    err = RankFailedError(3, "rank 3", "ValueError: x", None, [consequence])
    assert "also failed" in str(err) and "rank 0" in str(err)


def _behave(kind: str, path: str) -> str:
    count = int(os.environ.get(RESTART_COUNT_ENV, "0"))
    if kind == "die_once" and count == 0:
        os._exit(9)
    if kind == "raise_twice" and count < 2:
        raise OSError(f"attempt {count}")
    if kind == "wait_for_file":
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
    if kind == "write_file":
        with open(path, "w") as f:
            f.write("x")
    return f"{kind}:{count}"


def test_supervisor_restarts_and_processes_added_while_running(tmp_path):
    restarted = []
    sup = ProcessSupervisor(timeout=90, num_threads=1, on_restart=restarted.append)
    flag = str(tmp_path / "flag")
    sup.add(_behave, ("die_once", flag), name="a", restarts=1)
    sup.add(_behave, ("raise_twice", flag), name="b", restarts=2)
    sup.add(_behave, ("wait_for_file", flag), name="c")
    import threading

    late = threading.Thread(target=lambda: sup.add(_behave, ("write_file", flag), name="late"))
    timer = threading.Timer(1.0, late.start)
    timer.start()
    try:
        outcomes = sup.run()
    finally:
        timer.cancel()
    assert [o.value for o in outcomes] == [
        "die_once:1",
        "raise_twice:2",
        "wait_for_file:0",
        "write_file:0",
    ]
    assert [o.restarts for o in outcomes] == [1, 2, 0, 0]
    assert sorted(o.name for o in restarted) == ["a", "b", "b"]
    assert [o.raised for o in restarted if o.name == "b"] == [True, True]
    with pytest.raises(RuntimeError, match="has ended"):
        sup.add(_behave, ("write_file", flag))
    # out of restarts: the failure counts (here critical: the run raises it)
    with pytest.raises(RankFailedError, match="attempt 1"):
        run_processes(_behave, [("raise_twice", flag)], restarts=1, timeout=60)


def test_rank_exception_reraised_with_its_traceback():
    with pytest.raises(RankFailedError, match="boom from rank one") as info:
        spawn(_raise_on_rank_1, 2, timeout=60)
    err = info.value
    assert err.rank == 1
    assert "_raise_on_rank_1" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)


def test_hanging_rank_ends_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(ProcessTimeoutError, match="rank 1"):
        spawn(_hang_on_rank_1, 2, timeout=8)
    assert time.monotonic() - t0 < 8 + 15


def test_dead_rank_is_an_error_and_leaves_no_orphan():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 0 exited \(exit code 3\)"):
        spawn(_exit_on_rank_0, 2, timeout=60)
    assert time.monotonic() - t0 < 40
    import multiprocessing

    assert multiprocessing.active_children() == []


def test_run_processes_without_fail_fast_reports_each_outcome():
    seen = []
    outcomes = run_processes(_echo, [(1,), (-1,), (3,)], fail_fast=False, on_failure=seen.append)
    assert [o.ok for o in outcomes] == [True, False, True]
    assert [o.value for o in outcomes if o.ok] == [2, 6]
    assert outcomes[1].exitcode == 7 and "exit code 7" in outcomes[1].error
    assert [o.index for o in seen] == [1]


def test_children_are_gone_after_success():
    pids = spawn(_pid, 2, timeout=60)
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"nprocs": 0}, ValueError),
        ({"nprocs": 2, "args": [1]}, TypeError),
        ({"nprocs": 2, "timeout": -1}, ValueError),
    ],
)
def test_spawn_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        spawn(_pid, **kwargs)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: ProcessSupervisor(timeout=0), r"timeout must be a finite number > 0 \(seconds\)"),
        (lambda: ProcessSupervisor(grace=-1), r"grace must be a finite number >= 0 \(seconds\)"),
        (lambda: ProcessSupervisor(num_threads=0), r"num_threads must be None or an int >= 1"),
        (lambda: spawn(_pid, 2, num_threads=0), r"num_threads must be None or an int >= 1"),
        (lambda: spawn(_pid, True), r"nprocs must be an int >= 1, got True"),
        # a bad entry is named, and refused before the first process starts
        (lambda: run_processes(_pid, [(0, 1), (1, 1)], restarts=[0, -1]), r"restarts\[1\] must"),
    ],
)
def test_bad_arguments_are_named_before_any_process_starts(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_torchrun_main_outside_torchrun_says_how(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        torchrun_main(_pid)


_TORCHRUN_SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist
from distoptim.launch import torchrun_main


def work(rank, world_size, out):
    # an optimizer made while the group exists imports torch._dynamo (see launch.py)
    torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{rank} {world_size} {t.item():g}")


torchrun_main(work, sys.argv[1], backend="gloo")
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
with open(f"{sys.argv[1]}.threads.{os.environ['RANK']}", "w") as f:
    f.write(" ".join(sorted(threads)))
"""


@pytest.mark.timeout(120)
def test_same_function_runs_under_torchrun(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    subprocess.run([*cmd, str(script), str(out)], check=True, timeout=100, capture_output=True)
    assert sorted((tmp_path / f"out.{r}").read_text() for r in range(2)) == ["0 2 3", "1 2 3"]
    # the group is really gone after torchrun_main: no gloo thread left to abort at exit
    for r in range(2):
        assert "gloo" not in (tmp_path / f"out.threads.{r}").read_text()


# ---- start methods: forkserver (default) and spawn ------------------------------------------
def _env_and_parent(rank: int, world_size: int, keys: tuple[str, ...]) -> dict:
    import sys

    return {
        "env": {k: os.environ.get(k) for k in keys},
        "ppid": os.getppid(),
        "rank": (rank, os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "torch_before_main": "torch" in sys.modules,
    }


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_child_sees_the_launchers_environment_its_own_and_its_rank(method, monkeypatch):
    """A forked child inherits the forkserver's environment, not the launcher's: it is sent the
    launcher's as it is at the start (a variable set or removed after the server started)."""
    run_processes(_echo, [(1,)], start_method=method)  # the forkserver runs before the changes
    monkeypatch.setenv("DISTOPTIM_TEST_LATE", "set after the server started")
    monkeypatch.delenv("DISTOPTIM_TEST_GONE", raising=False)
    keys = ("DISTOPTIM_TEST_LATE", "DISTOPTIM_TEST_GONE", "RANK", "ONLY_RANK_0")
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
    envs = [torchrun_env(r, 2, stores[0].port) for r in range(2)]
    envs[0]["ONLY_RANK_0"] = "x"
    outcomes = run_processes(
        _with_process_group,
        [(_env_and_parent, "gloo", 30.0, (keys,))] * 2,
        envs=envs,
        start_method=method,
        timeout=60,
    )
    got = [o.value for o in outcomes]
    assert [g["rank"] for g in got] == [(0, "0", "2"), (1, "1", "2")]
    assert [g["env"] for g in got] == [
        {k: v for k, v in zip(keys, ("set after the server started", None, str(r), x))}
        for r, x in ((0, "x"), (1, None))
    ]
    forked = [g["ppid"] != os.getpid() for g in got]
    assert forked == [method == "forkserver"] * 2  # the forkserver is their parent


def _startup_env(keys: tuple[str, ...]) -> dict:
    import ctypes

    with open("/proc/self/environ", "rb") as f:  # what the process started with
        at_start = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    libc10 = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    return {
        "at_start": {k: at_start.get(k.encode(), b"").decode() or None for k in keys},
        "cpp_log_level": ctypes.c_int.in_dll(ctypes.CDLL(libc10), "FLAGS_caffe2_log_level").value,
        "threads": torch.get_num_threads(),
    }


def test_forkserver_refuses_a_variable_read_at_start_which_spawn_sets_at_start():
    env = {"MALLOC_ARENA_MAX": "2"}
    with pytest.raises(RankFailedError, match=r'MALLOC_ARENA_MAX .* start_method="spawn"') as info:
        run_processes(_startup_env, [(("MALLOC_ARENA_MAX",),)], envs=[env], timeout=60)
    assert isinstance(info.value.__cause__, ValueError)
    (out,) = run_processes(
        _startup_env, [(("MALLOC_ARENA_MAX",),)], envs=[env], start_method="spawn", timeout=60
    )
    assert out.value["at_start"] == env  # in place before the interpreter's first instruction


def test_forkserver_child_applies_what_torch_reads_as_it_loads():
    """TORCH_CPP_LOG_LEVEL and OMP_NUM_THREADS: the forkserver's torch read them long before."""
    envs = [
        {"TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"},
        {"TORCH_CPP_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "2"},
    ]
    sup = ProcessSupervisor(timeout=60)  # num_threads=None: torch's default, or the variable's
    for env in envs:
        sup.add(_startup_env, ((),), env=env)
    outcomes = sup.run()
    assert [(o.value["cpp_log_level"], o.value["threads"]) for o in outcomes] == [(2, 1), (0, 2)]


def _mask_and_parent() -> tuple[list[int], int]:
    import signal

    return sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ())), os.getppid()


def test_forked_child_has_the_launchers_signal_mask_and_its_server_outlives_group_signals():
    """A forked child inherits the server's mask (which holds SIGINT, SIGTERM and SIGHUP, so that
    a Ctrl-C or a closed terminal does not end the server and every child with it): it takes
    the mask of the launcher's thread that started it, as a spawned child would."""
    import signal

    (free,) = run_processes(_mask_and_parent, [()], timeout=60)
    mask, server = free.value
    assert mask == [] and server != os.getpid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        os.kill(server, sig)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    try:
        sup = ProcessSupervisor(timeout=60)
        sup.add(_mask_and_parent)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    (held,) = sup.run()
    assert held.value == ([int(signal.SIGTERM)], server)  # the same server, still serving


def _draws() -> tuple[int, float, float]:
    import numpy as np

    return torch.initial_seed(), float(torch.rand(1)), float(np.random.rand())


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_every_child_draws_its_own_random_numbers(method):
    """A forked child would draw the server's numbers: each is seeded afresh, as when spawned."""
    draws = [o.value for o in run_processes(_draws, [(), ()], start_method=method, timeout=60)]
    assert all(a != b for a, b in zip(*draws)), draws


def test_start_method_is_checked():
    with pytest.raises(ValueError, match="start_method"):
        ProcessSupervisor(start_method="fork")


_LAUNCHER_SCRIPT = """
import os
import sys
import threading
from distoptim.launch import ProcessSupervisor


def child():
    print(os.getpid(), os.getppid(), flush=True)
    threading.Event().wait(90)  # bounded: the test kills the launcher long before


if __name__ == "__main__":
    sup = ProcessSupervisor(timeout=120, start_method=sys.argv[1])
    sup.add(child)
    sup.run()
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_child_dies_within_seconds_when_its_launcher_is_killed(method, tmp_path):
    """Under the forkserver the child's parent is the server, which every forked child keeps
    alive: the child sees its launcher's death through its lifeline, and the server ends too."""
    import select
    import subprocess
    import sys

    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER_SCRIPT)
    launcher = subprocess.Popen(
        [sys.executable, str(script), method], stdout=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([launcher.stdout], [], [], 90)
        assert ready, "the child did not start"
        child, parent = map(int, launcher.stdout.readline().split())
        assert (parent == launcher.pid) == (method == "spawn")
        watched = [os.pidfd_open(p) for p in {child, parent} - {launcher.pid}]
        launcher.kill()
        launcher.wait(10)
        t0 = time.monotonic()
        for fd in watched:  # readable once the process has ended
            ready, _, _ = select.select([fd], [], [], 20)
            assert ready, "the child (or its forkserver) outlived the launcher"
        assert time.monotonic() - t0 < 20
        assert not _alive(child) and not _alive(parent)
    finally:
        launcher.kill()
        launcher.wait(10)
