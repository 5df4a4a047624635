"""cli.pool: tasks on reused processes with clean state; a death or a timeout ends the pool."""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch

from distoptim.cli.pool import PoolBrokenError, ProcessPool, Task
from distoptim.launch import ProcessTimeoutError, RankFailedError

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def _state(context, tag):
    """What a task sees: the context, its env, threads, a draw from every RNG, its pid."""
    return {
        "context": context,
        "tag": tag,
        "env": os.environ.get("DISTOPTIM_POOL_TEST"),
        "threads": torch.get_num_threads(),
        "draws": (torch.rand(1).item(), float(np.random.rand()), random.random()),
        "pid": os.getpid(),
    }


def _raise(context, message):
    raise ValueError(message)


def _die(context):
    os._exit(3)


def _hang(context):
    threading.Event().wait()  # a task that never returns on its own


def test_pool_reuses_processes_with_clean_state_and_ends_on_death_or_timeout():
    pool = ProcessPool(2, context={"data": 7})
    try:
        assert pool.start() > 0 and pool.alive
        first = pool.run(
            [Task(_state, ("a",), {"DISTOPTIM_POOL_TEST": "x"}, threads=1, seed=5)] * 2,
            timeout=60,
        )
        again = pool.run([Task(_state, ("b",), threads=2, seed=5)], timeout=60)
        a, b = first[0].value, again[0].value
        assert a["context"] == {"data": 7} and a["tag"] == "a" and a["env"] == "x"
        assert b["env"] is None  # the run's variables left with the run
        assert b["pid"] == a["pid"] and b["threads"] == 2  # same process, the run's threads
        assert b["draws"] == a["draws"] == first[1].value["draws"]  # seeds reset per task
        assert first[1].value["pid"] != a["pid"]
        with pytest.raises(ValueError, match=r"a run needs 1\.\.2 processes, got 3"):
            pool.run([Task(_state, ("x",))] * 3, timeout=60)

        # a task that raises: an outcome (fail_fast=False) or RankFailedError; pool lives on
        outs = pool.run(
            [Task(_raise, ("boom",)), Task(_state, ("c",))], timeout=60, fail_fast=False
        )
        assert not outs[0].ok and "ValueError: boom" in outs[0].headline() and outs[1].ok
        with pytest.raises(RankFailedError, match="rank 0 failed: ValueError: boom"):
            pool.run([Task(_raise, ("boom",))], timeout=60)
        assert not pool.alive  # fail-fast killed the pool: its peers may be stuck
        with pytest.raises(PoolBrokenError, match="cannot run tasks"):
            pool.run([Task(_state, ("d",))], timeout=60)
    finally:
        pool.kill()

    pool = ProcessPool(1)
    try:
        pool.start()
        with pytest.raises(PoolBrokenError, match="died during the run"):
            pool.run([Task(_die, ())], timeout=60)
        assert not pool.alive
    finally:
        pool.kill()

    pool = ProcessPool(1)
    try:
        pool.start()
        pid = pool._pids[0]
        with pytest.raises(ProcessTimeoutError, match=r"did not finish within 0\.5s"):
            pool.run([Task(_hang, ())], timeout=0.5)
        assert not pool.alive
        assert not os.path.exists(f"/proc/{pid}/cmdline") or _zombie_or_gone(pid)
    finally:
        pool.kill()


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_pool_size_and_task_count_are_checked():
    with pytest.raises(ValueError, match="pool size must be an int >= 1"):
        ProcessPool(0)
    pool = ProcessPool(1)
    with pytest.raises(PoolBrokenError, match="not started"):
        pool.run([Task(_state, ("x",))], timeout=1)
