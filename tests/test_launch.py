"""distoptim.launch: return values, errors with tracebacks, hangs and deaths end within timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distoptim.launch import (
    ProcessTimeoutError,
    RankFailedError,
    run_processes,
    spawn,
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
