"""distoptim.agn under faults and membership changes (p2p): real local clusters.

Four small runs, each checking several behaviours:

* elastic: a late worker joins a running cluster, pulls the current center and commits; a worker
  leaves early without stalling anyone; the center guard refuses a commit whose result would be
  Inf (and its hyperparameters do not stick); a clean end prints nothing (children's stderr);
  the flat buffers travel on the gloo pairs here (shared memory off), as between machines;
* restart: a shard killed mid-run is restarted from its checkpoint, the workers reconnect and go
  on; the commits lost are bounded by ``checkpoint_every`` (plus those in flight);
* a checkpoint directory removed mid-run (``max_restarts=1``) is named by the commit that made a
  checkpoint due, at once, and the shard is not restarted empty;
* a worker killed during start-up fails the run within seconds, naming that worker;
* the same death with ``on_startup_failure="drop"`` is dropped, while another worker's exception
  still reaches the caller (root cause first, the death listed after it);
* two jobs at one store keep apart (a namespace per job id), a third with a taken job id is
  refused at once, and the checkpoint directory of one of them removed mid-run is named as the
  cause within seconds.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import distoptim
from distoptim.agn import Cluster, ClusterOptions, LocalCluster, WorkerStartupError, spawn
from distoptim.agn.transport.messages import Ping
from distoptim.launch import RankFailedError, run_processes, torchrun_env

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _step(opt, model, g: torch.Generator, scale: float = 1.0) -> list[str]:
    opt.zero_grad()
    x = scale * torch.randn(8, 4, generator=g)
    (model(x) - 1.0).pow(2).mean().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return [str(w.message) for w in caught if w.category is RuntimeWarning]


def _agn(ctx, model, lr=0.05):
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), ctx.num_worker, communication_period=1
    )
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()
    return opt


def _wait_for(path: Path, seconds: float) -> bool:
    """Poll for a file another process writes (a bounded wait on a condition)."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---------------------------------------------------------------------------------------------
# elastic: join, leave, center guard, quiet end
# ---------------------------------------------------------------------------------------------
def _elastic_worker(ctx, out_dir: str) -> dict:
    out_path = Path(out_dir)
    model = _model()
    opt = _agn(ctx, model)
    g = torch.Generator().manual_seed(ctx.task_index)
    out = {"task": ctx.task_index, "late": ctx.is_late, "version_at_init": opt.global_step}
    if ctx.is_late:
        for _ in range(3):
            _step(opt, model, g)
        out["commits"] = 3
        ctx.store.set("test/late_done", "1")
        return out
    if ctx.task_index == 1:  # the center guard, then leave early
        _step(opt, model, g)
        opt.param_groups[0]["lr"] = 3e38  # the server follows it: lr * g overflows float32
        out["guard_warnings"] = _step(opt, model, g, scale=100.0)
        out["center_finite"] = all(torch.isfinite(c).all() for c in opt.center_variables())
        opt.param_groups[0]["lr"] = 0.05
        out["after_guard"] = _step(opt, model, g)
        out["commits"] = 3
        return out
    for _ in range(3):
        _step(opt, model, g)
    (out_path / "w0_ready").write_text("1")  # the test adds the late worker now
    ctx.store.wait(["test/late_done"], timedelta(seconds=90))  # still in the cluster meanwhile
    for _ in range(2):
        _step(opt, model, g)
    out["commits"] = 5
    return out


def test_late_worker_joins_one_leaves_guard_refuses_and_the_end_is_quiet(
    tmp_path, capfd, monkeypatch
):
    # buffers on the gloo pair, as between machines (the other p2p runs use shared memory)
    monkeypatch.setenv("DISTOPTIM_AGN_SHM", "0")
    with LocalCluster(_elastic_worker, 2, 1, (str(tmp_path),), timeout=120, rpc_timeout=30) as c:
        c.start()
        assert _wait_for(tmp_path / "w0_ready", 90)
        late = c.add_worker()
        result = c.wait()
    assert late == 2
    w0, w1, w2 = result.worker_results
    assert w2["late"] and not w0["late"]
    assert w2["version_at_init"] >= 3  # it pulled the current center, not the chief's seed
    stats = result.stats
    assert stats.commits_per_worker[2] == 3
    assert stats.commits_per_worker[1] == 2  # the third commit was refused by the guard
    assert stats.commits_per_worker[0] == w0["commits"]
    assert stats.dead_workers == [] and stats.failed_workers == []
    assert stats.refused_commits == 1 and stats.refused_results == 1
    assert len(w1["guard_warnings"]) == 1 and "non-finite" in w1["guard_warnings"][0]
    assert w1["center_finite"] and w1["after_guard"] == []  # the huge lr did not stick
    assert all(torch.isfinite(c).all() for c in result.center)
    assert stats.global_step == sum(stats.commits_per_worker.values())
    err = capfd.readouterr().err
    noise = [
        line
        for line in err.splitlines()
        if any(w in line for w in ("gloo", "Connection", "tensorpipe", "[W", "[E", "Traceback"))
    ]
    assert noise == [], err


# ---------------------------------------------------------------------------------------------
# shard restart
# ---------------------------------------------------------------------------------------------
def _restart_worker(ctx, steps: int, kill_at: int) -> dict:
    model = _model()
    opt = _agn(ctx, model)
    ctx.store.set(f"test/ready/{ctx.task_index}", "1")  # connected and initialized
    g = torch.Generator().manual_seed(ctx.task_index)
    versions = []
    killed_at = resumed_at = None
    for k in range(steps):
        if ctx.is_chief and k == kill_at:
            # the other worker must be past its initialization (connect, shared-memory set-up,
            # first pull): a shard death during it fails that worker (docs/agn.md, Shard restart)
            ctx.store.wait([f"test/ready/{1 - ctx.task_index}"], timedelta(seconds=90))
            os.kill(ctx.request(0, Ping()).pid, signal.SIGKILL)
            killed_at = time.monotonic()
            ctx.store.set("test/killed", "1")
        elif k == kill_at:  # the other worker is surely mid-run when the shard dies
            ctx.store.wait(["test/killed"], timedelta(seconds=90))
        _step(opt, model, g)
        versions.append(opt.global_step)
        if killed_at is not None and resumed_at is None:
            resumed_at = time.monotonic()
    return {
        "versions": versions,
        "incarnation": ctx.incarnation(0),
        "resume_s": None if killed_at is None else resumed_at - killed_at,
        "lost_in_flight": opt.lost_commits,
    }


def test_shard_killed_mid_run_is_restarted_from_its_checkpoint(tmp_path):
    steps, every = 12, 3
    result = spawn(
        _restart_worker,
        2,
        num_ps=1,
        args=(steps, 5),
        timeout=120,
        rpc_timeout=30,
        checkpoint_dir=tmp_path,
        checkpoint_every=every,
        max_restarts=1,
        # a fresh shard process imports torch and loads its checkpoint: slow on a loaded machine
        reconnect_timeout=90,
    )
    chief, other = result.worker_results
    assert result.stats.shard_restarts == 1
    assert chief["incarnation"] == 2 and other["incarnation"] == 2
    assert chief["resume_s"] is not None and chief["resume_s"] < 90
    assert chief["lost_in_flight"] == other["lost_in_flight"] == 1  # the commit the death cut
    sent = 2 * steps
    rolled_back = sent - result.stats.global_step - result.stats.refused_commits - 2
    assert 0 <= rolled_back <= every, rolled_back  # accepted after the latest checkpoint
    assert result.stats.per_optimizer["AGNOptimizer"]["resumed"]
    assert sorted(os.listdir(tmp_path)) == ["ps0.pt"]  # no temporary file left behind
    assert all(torch.isfinite(c).all() for c in result.center)


def _vanishing_dir_worker(ctx, ckpt: str) -> None:
    """The chief's second commit makes a checkpoint due after the directory was removed."""
    import shutil

    model = _model()
    opt = _agn(ctx, model)
    g = torch.Generator().manual_seed(0)
    _step(opt, model, g)
    shutil.rmtree(ckpt)
    _step(opt, model, g)


def test_checkpoint_dir_removed_mid_run_is_named_at_once(tmp_path):
    """With ``max_restarts=1`` the shard used to die writing, come back with nothing to resume,
    and the worker failed after the whole ``rpc_timeout`` asking whether a chief was running."""
    ckpt = tmp_path / "ckpt"
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(
            _vanishing_dir_worker,
            1,
            num_ps=1,
            args=(str(ckpt),),
            timeout=150,
            rpc_timeout=90,
            checkpoint_dir=ckpt,
            checkpoint_every=1,
            max_restarts=1,
        )
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert f"checkpoint {ckpt / 'ps0.pt'}" in message, message
    assert "checkpoint_dir removed" in message, message
    assert "is a chief running" not in message
    assert elapsed < 60, elapsed  # start-up included; never the whole rpc_timeout


# ---------------------------------------------------------------------------------------------
# death during start-up; exceptions reach the caller
# ---------------------------------------------------------------------------------------------
def _short_worker(ctx) -> int:
    model = _model()
    opt = _agn(ctx, model)
    g = torch.Generator().manual_seed(ctx.task_index)
    for _ in range(3):
        _step(opt, model, g)
    if ctx.task_index == 1:
        raise ValueError("worker one's own mistake")
    return opt.global_step


def test_worker_killed_during_startup_fails_the_run_within_seconds_naming_it():
    c = LocalCluster(_short_worker, 2, 1, timeout=120, rpc_timeout=30)
    with c:
        c.start()
        os.kill(c.pid("worker 1"), signal.SIGKILL)  # it is still importing torch
        t0 = time.monotonic()
        with pytest.raises(WorkerStartupError, match="worker 1 failed: died during start-up"):
            c.wait()
        elapsed = time.monotonic() - t0
    assert elapsed < 15, elapsed  # the parent saw it at once; stopping the others takes the rest


def test_dropped_startup_death_and_a_workers_exception_reaches_the_caller():
    c = LocalCluster(_short_worker, 3, 1, timeout=120, rpc_timeout=30, on_startup_failure="drop")
    with c:
        c.start()
        os.kill(c.pid("worker 2"), signal.SIGKILL)
        with pytest.raises(RankFailedError, match="worker one's own mistake") as info:
            c.wait()
    err = info.value
    assert err.name == "worker 1" and isinstance(err.__cause__, ValueError)
    assert "_short_worker" in err.remote_traceback
    assert [o.name for o in err.others] == ["worker 2"]
    assert "killed by signal 9" in err.others[0].headline()


# ---------------------------------------------------------------------------------------------
# torchrun's own restarts
# ---------------------------------------------------------------------------------------------
_TORCHRUN_SCRIPT = """
import json, os, signal, sys
import torch
import distoptim
from distoptim.agn import Cluster
from distoptim.agn.transport.messages import Ping

ckpt, out = sys.argv[1], sys.argv[2]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
cluster = Cluster.from_env(num_ps=1, checkpoint_dir=ckpt, checkpoint_every=2)
if cluster.is_ps:
    cluster.serve()
    cluster.shutdown()
    sys.exit(0)
with cluster:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), cluster.num_worker, communication_period=1
    )
    hook = opt.make_session_run_hook(cluster.is_chief, cluster.task_index)
    hook.begin()
    hook.after_create_session()
    at_init = opt.global_step
    for k in range(6):
        if attempt == 0 and cluster.is_chief and k == 5:
            os.kill(cluster.request(0, Ping()).pid, signal.SIGKILL)  # torchrun restarts the job
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    with open(f"{out}.{attempt}.{cluster.task_index}", "w") as f:
        json.dump({"at_init": at_init, "end": opt.global_step}, f)
"""


def test_torchrun_restarts_the_job_and_the_shard_resumes_from_its_checkpoint(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    cmd += ["--max-restarts", "1", str(script), str(tmp_path / "ckpt"), str(out)]
    proc = subprocess.run(cmd, timeout=140, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = [json.loads((tmp_path / f"out.1.{t}").read_text()) for t in (0, 1)]
    assert not (tmp_path / "out.0.0").exists()  # the first attempt ended at the kill
    assert all(w["at_init"] >= 4 for w in second)  # the resumed center, not a fresh seed
    assert all(w["end"] >= w["at_init"] + 6 for w in second)


# ---------------------------------------------------------------------------------------------
# two jobs at one store
# ---------------------------------------------------------------------------------------------
def _job_main(options: ClusterOptions, remove: str | None) -> dict:
    """One process of a job of one shard and one worker; the worker removes ``remove`` (the
    job's checkpoint directory) after its first commit."""
    import shutil

    cluster = Cluster.from_env(num_ps=1, options=options)
    if cluster.is_ps:
        try:
            return {"report": cluster.serve()}
        finally:
            cluster.shutdown()
    with cluster:
        model = _model()
        opt = _agn(cluster, model)
        g = torch.Generator().manual_seed(0)
        _step(opt, model, g)
        out: dict = {"namespace": cluster.namespace}
        if remove is not None:
            shutil.rmtree(remove)
        t0 = time.monotonic()
        try:
            for _ in range(2):
                _step(opt, model, g)
        except RuntimeError as exc:
            out |= {"error": str(exc), "seconds": time.monotonic() - t0}
        out["global_step"] = opt.global_step
        return out


def test_two_jobs_at_one_store_keep_apart_and_a_taken_job_id_is_refused(tmp_path, monkeypatch):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ckpt = tmp_path / "ckpt_a"
    a = ClusterOptions(rpc_timeout=60, checkpoint_dir=ckpt, checkpoint_every=1)
    b = ClusterOptions(rpc_timeout=60)
    jobs = [("a", a, str(ckpt)), ("b", b, None)]
    outcomes = run_processes(
        _job_main,
        [(options, remove) for _, options, remove in jobs for _ in range(2)],
        timeout=120,
        envs=[
            {**torchrun_env(rank, 2, store.port), "DISTOPTIM_AGN_JOB": job}
            for job, _, _ in jobs
            for rank in range(2)
        ],
        names=[f"{job} {role}" for job, _, _ in jobs for role in ("ps 0", "worker 0")],
        fail_fast=False,
    )
    _, a_worker, b_shard, b_worker = outcomes
    assert b_shard.ok and b_worker.ok, [o.headline() for o in outcomes]
    # job b ran alone in its namespace: its own three commits, none of job a's
    assert b_worker.value["namespace"] == "distoptim.agn/b/0"
    assert b_worker.value["global_step"] == 3
    assert b_shard.value["report"].stats.commits_per_worker == {0: 3}
    # job a: the commit that made a checkpoint due names the removed directory, at once
    assert a_worker.ok and a_worker.value["namespace"] == "distoptim.agn/a/0"
    error = a_worker.value["error"]
    assert f"could not write its checkpoint {ckpt / 'ps0.pt'}" in error, error
    assert "checkpoint_dir removed during the run" in error
    assert a_worker.value["seconds"] < 20
    # a third job with job b's id at the same store stops at once, before writing anything
    monkeypatch.setenv("DISTOPTIM_AGN_JOB", "b")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 of the job in the store namespace "):
        Cluster(rank=0, world_size=2, num_ps=1, master_addr="127.0.0.1", master_port=store.port)
    assert time.monotonic() - t0 < 10
