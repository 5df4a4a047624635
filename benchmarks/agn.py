"""Benchmark: the parameter server's two transports side by side, against raw echoes, and faults.

Model: the AGN paper's MNIST MLP 784-1000-2000-1000-10 (4,798,010 float32 parameters, 19.2 MB).
Every process runs on this machine (loopback). Sections (all by default):

* ``passes`` -- the cost of each pass over the payload a commit makes, timed alone in one
  process (median of repeats): the worker's ``a/λ``, the shard's checks, backup, optimizer step,
  and the worker's copy of the reply into its parameters.
* ``round trip`` -- one shard process serving **both** transports (a table each, so one's
  commits do not disturb the other's) and one worker process connected by both; in one shuffled
  order per repetition the worker times: an AGN commit+pull (``AGNOptimizer._commit``) over p2p
  and over rpc, a raw echo of the same bytes (the ``Echo`` request: the shard sends the buffers
  back as they came) over each, and
  the two passes a commit cannot avoid beyond moving its bytes, on the same bytes in the
  worker's process: the server optimizer's step and the copy of the reply into the parameters.
  A commit's **floor** is its transport's echo + that step + that copy of the same repetition;
  paired ratios: commit / floor (the target: <= 1.15), p2p commit / p2p echo, p2p / rpc commit.
  With 1 and 2 shards in shared memory, 1 shard on the gloo pair, and both of these with
  streamed commits (``DISTOPTIM_AGN_STREAM=1``) instead of whole ones.
* ``throughput`` -- aggregate accepted commits/s with 1, 2 and 4 workers on one shard, every
  worker stepping as fast as it can at λ=1 (fixed gradients: the PS path, not the model); the
  transports alternate in phases p2p, rpc, rpc, p2p (ABBA, so drift hits both alike), each
  phase starting from a store barrier.
* ``faults`` -- (p2p) time from a shard's SIGKILL to the workers' next completed step after the
  automatic restart, and the commits lost; then, in the same cluster, time from
  ``LocalCluster.add_worker()`` to the late worker's first commit (and from its join); time
  until ``wait()`` raises when a worker dies during start-up; then the real-cause trials:
  ``--trials`` runs each of ``distoptim.launch.spawn`` (rank 1 raises ``ValueError`` between
  collectives) and ``distoptim.agn.spawn`` (worker 1 of 3 raises it between commits), counting
  how often the caller saw that error.

Run::

    python benchmarks/agn.py                   # everything, ~10 minutes on 2 busy cores
    python benchmarks/agn.py --quick           # a smoke run: all but the faults, one cluster
    python benchmarks/agn.py --quick --only faults  # the fault scenarios' smoke run
    python benchmarks/agn.py --only round_trip --reps 30

Prints medians and paired ratios; writes ``benchmarks/results/agn.json`` (a ``--quick`` run:
``benchmarks/results/quick/agn.json``) with the machine's load average at the start and end
of each section (on a shared 2-core machine the figures move with the load); ``--only``
updates its sections and keeps the others. The round trip runs five
configurations: 1 and 2 shards with p2p's shared memory (same machine), 1 shard with p2p's
buffers on the gloo pair (``DISTOPTIM_AGN_SHM=0``: what p2p does across machines), and the
first and third with streamed commits.
``--quick`` (a smoke run that checks the sections still work, not a measurement) runs them
once in their smallest form, in one cluster of one shard and one worker -- process starts and
torch's import are most of its cost: the passes and the round trip (1 shard, shared memory) 2
reps each and the throughput (1 worker, 0.2 s phases), both transports in each, with their
paired ratios. The fault scenarios start ten processes, three times the rest of a quick run:
``--quick --only faults`` runs them with one worker each (the shard killed at step 4, after its
checkpoint at step 3).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import Bench, load, machine
from torch import nn

import distoptim
from distoptim.agn import Cluster, LocalCluster, WorkerStartupError, spawn
from distoptim.agn.center_guard import Backup, BackupUnit, finite
from distoptim.agn.flat import FlatLayout
from distoptim.agn.transport.messages import Echo, EchoReply, Ping
from distoptim.agn.transport.rpc import RpcTransport
from distoptim.launch import RankFailedError, run_processes, torchrun_env
from distoptim.launch import spawn as launch_spawn

SIZES = (784, 1000, 2000, 1000, 10)
SECTIONS = ("passes", "round_trip", "throughput", "faults")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


# ---------------------------------------------------------------------------------------------
# passes
# ---------------------------------------------------------------------------------------------
def _time(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return _median_ms(out)


def _passes(reps: int) -> dict[str, float]:
    torch.set_num_threads(1)  # as in a cluster process on 2 cores
    model = _mlp()
    params = list(model.parameters())
    layout = FlatLayout([(p.shape, p.dtype) for p in params])
    acc = layout.flatten([torch.randn_like(p) for p in params])
    center = layout.flatten(params)
    views = layout.views(center)
    opt = torch.optim.SGD(views, lr=1e-9)
    grads = layout.views(acc)
    # the guard's backup of the whole center and the optimizer's state, as one unit
    whole = [(k, 0, t.numel()) for k, t in center.items()]
    backup = Backup(center, [BackupUnit(whole, views)], opt)

    def step():
        for p, g in zip(views, grads):
            p.grad = g
        opt.step()

    return {
        "worker: a/λ in place": _time(lambda: acc["float32"].div_(1.0), reps),
        "shard: finite check (sum)": _time(lambda: finite(center), reps),
        "shard: backup copy": _time(lambda: backup.take(0, center, -1), reps),
        "shard: SGD step": _time(step, reps),
        "worker: reply -> parameters": _time(
            lambda: torch._foreach_copy_([p.detach() for p in params], views), reps
        ),
        "one memcpy of the payload": _time(lambda: center["float32"].clone(), reps),
    }


# ---------------------------------------------------------------------------------------------
# processes that serve / use both transports
# ---------------------------------------------------------------------------------------------
def _dual_main(num_ps: int, mode: str, args: tuple[Any, ...]) -> Any:
    """One process of a cluster whose shards serve p2p and rpc over the same tables."""
    cluster = Cluster.from_env(num_ps=num_ps, transport="p2p", rpc_timeout=120)
    p2p = cluster.transport
    rpc_t = RpcTransport(cluster.rank, num_ps, cluster.num_worker, 120.0)
    try:
        if cluster.is_ps:
            rpc_t.serve(cluster._server)  # the same shard behind the second transport
            return cluster.serve()
        transports = {"p2p": p2p, "rpc": rpc_t}
        return _MODES[mode](cluster, transports, *args)
    finally:
        cluster.transport = p2p
        cluster.shutdown()
        rpc_t.close()


def _run_dual(
    num_worker: int,
    num_ps: int,
    mode: str,
    args: tuple[Any, ...],
    shm: bool = True,
    stream: bool = False,
) -> list[Any]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world = num_ps + num_worker
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR"}  # rpc's shut-down without a barrier logs per pipe
    env["DISTOPTIM_AGN_SHM"] = "1" if shm else "0"  # 0: p2p buffers on the gloo pair
    env["DISTOPTIM_AGN_STREAM"] = "1" if stream else "0"  # 1: commits streamed in chunks
    outcomes = run_processes(
        _dual_main,
        [(num_ps, mode, args)] * world,
        timeout=900,
        envs=[{**torchrun_env(r, world, store.port), **env} for r in range(world)],
        names=[f"ps {s}" for s in range(num_ps)] + [f"worker {t}" for t in range(num_worker)],
        num_threads=1,
    )
    return [o.value for o in outcomes[num_ps:]]


_Agn = dict[str, tuple[nn.Module, distoptim.AGNOptimizer]]


def _agn(ctx) -> _Agn:
    """Per transport, a model and its AGN optimizer: a table of its own on the shards, so that
    one transport's commits never leave the other's center guard backup stale (a shard takes it
    ahead after answering on p2p; an rpc commit to the same table would put that copy back on
    the next p2p commit's path -- an artifact of serving both, not what a run on one sees)."""
    out: _Agn = {}
    for kind in ("p2p", "rpc"):
        model = _mlp()
        opt = distoptim.AGNOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-9),
            ctx.num_worker,
            communication_period=1,
            name=f"AGN over {kind}",
        )
        hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
        hook.begin()
        hook.after_create_session()
        g = torch.Generator().manual_seed(ctx.task_index)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        out[kind] = (model, opt)
    return out


def _echo(ctx, flats: list[torch.Tensor]) -> None:
    """A raw echo of the same bytes a commit moves: one buffer per shard, in parallel."""
    pending = [ctx.send(s, Echo({"float32": f})) for s, f in enumerate(flats)]
    for p in pending:
        reply = ctx.receive(p)
        assert isinstance(reply, EchoReply)


class _Floor:
    """What a commit cannot avoid beyond moving its bytes, on the worker's own copy of them: the
    server optimizer's step (the same class and ``lr`` as the shard's, over center-sized buffers
    of each shard's share) and the copy of the reply into the parameters. A round trip's floor is
    its echo (the bytes moved there and back) plus these two passes; shards step in parallel, so
    the step's part is the slowest shard's."""

    def __init__(self, model: nn.Module, opt: distoptim.AGNOptimizer) -> None:
        self._steps = []
        replies = []
        for link in opt._conn.links:
            center = link.layout.flatten(link.params)
            views = link.layout.views(center)
            grads = link.layout.views(link.layout.flatten([p.grad for p in link.params]))
            self._steps.append((torch.optim.SGD(views, lr=1e-9), views, grads))
            replies.append((link.params, views))
        self._targets = [p.detach() for params, _ in replies for p in params]
        self._sources = [v for _, views in replies for v in views]

    def step(self) -> float:
        """Seconds of the slowest shard's step."""
        slowest = 0.0
        for sgd, views, grads in self._steps:
            t = time.perf_counter()
            for v, g in zip(views, grads):
                v.grad = g
            sgd.step()
            slowest = max(slowest, time.perf_counter() - t)
        return slowest

    def copy(self) -> float:
        """Seconds of the reply's copy into the parameters."""
        t = time.perf_counter()
        torch._foreach_copy_(self._targets, self._sources)
        return time.perf_counter() - t


def _round_trip(ctx, transports, reps: int, agn: _Agn | None = None) -> dict[str, Any]:
    """Per repetition, in a shuffled order: a commit and an echo on each transport, and the
    floor's two passes (:class:`_Floor`)."""
    agn = agn or _agn(ctx)
    model, opt = agn["p2p"]
    n = sum(p.numel() for p in model.parameters())
    flat = [torch.randn(link.layout.numel()) for link in opt._conn.links]
    floor = _Floor(model, opt)
    times: dict[str, list[float]] = {
        f"{k}_{op}": [] for k in transports for op in ("commit", "echo")
    }
    times |= {"floor_step": [], "floor_copy": []}
    rng = random.Random(0)
    for i in range(reps + 2):  # two warm-up rounds
        order = list(times)
        rng.shuffle(order)
        for key in order:
            kind, op = key.split("_")
            if kind == "floor":
                took = floor.step() if op == "step" else floor.copy()
            else:
                ctx.transport = transports[kind]
                t = time.perf_counter()
                if op == "commit":
                    agn[kind][1]._commit()
                else:
                    _echo(ctx, flat)
                took = time.perf_counter() - t
            if i >= 2:
                times[key].append(took)
    return {"params": n, "times": times}


def _barrier(ctx, name: str) -> None:
    store = ctx.store
    store.add(name, 1)
    deadline = time.monotonic() + 120
    while int(store.add(name, 0)) < ctx.num_worker:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name} not reached")
        time.sleep(0.001)


def _throughput(ctx, transports, seconds: float, agn: _Agn | None = None) -> list[dict[str, Any]]:
    agn = agn or _agn(ctx)
    out = []
    for phase, kind in enumerate(("p2p", "rpc", "rpc", "p2p")):
        _barrier(ctx, f"bench/phase{phase}")
        ctx.transport = transports[kind]
        start = time.time()
        steps = 0
        while time.time() - start < seconds:
            agn[kind][1].step()  # λ=1: local SGD step + accumulate + commit + pull
            steps += 1
        out.append({"kind": kind, "phase": phase, "start": start, "end": time.time(), "n": steps})
    return out


def _both(ctx, transports, reps: int, seconds: float, passes: bool = False) -> dict[str, Any]:
    """``--quick``: the round trip, then the throughput -- and with ``passes`` the passes first
    -- in one cluster of one shard and one worker (starting a process and importing torch costs
    more than all of them: this worker has paid for it already)."""
    out = {"passes": _passes(reps)} if passes else {}
    agn = _agn(ctx)
    out["round_trip"] = _round_trip(ctx, transports, reps, agn)
    out["throughput"] = _throughput(ctx, transports, seconds, agn)
    return out


_MODES = {"round_trip": _round_trip, "throughput": _throughput, "both": _both}


# ---------------------------------------------------------------------------------------------
# faults
# ---------------------------------------------------------------------------------------------
def _small(ctx):
    model = nn.Linear(32, 4)
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), ctx.num_worker, communication_period=1
    )
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()
    return model, opt


def _small_step(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()


def _restart_fn(ctx, steps: int, kill_at: int, out_dir: str) -> dict[str, Any]:
    """The shard is killed mid-run (by the chief, at step ``kill_at``) and restarted; once the
    workers made their ``steps``, the chief keeps committing until a late worker, added by the
    parent then, has made its first commit."""
    joined = time.time()
    model, opt = _small(ctx)
    path = Path(out_dir)
    if ctx.is_late:
        _small_step(model, opt)
        (path / "late_done").write_text("1")
        return {"joined": joined, "first_commit": time.time(), "steps": 1, "lost": 0}
    ctx.store.set(f"bench/ready/{ctx.task_index}", "1")  # connected and initialized
    killed = resumed = None
    for k in range(steps):
        if ctx.is_chief and k == kill_at:
            # the others must be past their initialization: a shard death during it fails a
            # worker (docs/agn.md, Shard restart)
            others = [f"bench/ready/{t}" for t in range(1, ctx.num_worker)]
            if others:
                ctx.store.wait(others, timedelta(seconds=300))
            os.kill(ctx.request(0, Ping()).pid, signal.SIGKILL)
            killed = time.monotonic()
            ctx.store.set("bench/killed", "1")
        elif k == kill_at:  # mid-run when the shard dies
            ctx.store.wait(["bench/killed"], timedelta(seconds=300))
        _small_step(model, opt)
        if killed is not None and resumed is None:
            resumed = time.monotonic()
    n = steps
    if ctx.is_chief:  # the cluster runs on while the late worker joins
        (path / "ready").write_text("1")
        deadline = time.monotonic() + 300
        while not (path / "late_done").exists() and time.monotonic() < deadline:
            _small_step(model, opt)
            n += 1
            time.sleep(0.01)  # leave the cores to the late worker's start
    return {
        "resume_s": None if killed is None else resumed - killed,
        "lost": opt.lost_commits,
        "steps": n,
    }


def _raise_after_commits(ctx, raiser: int = 1) -> int:
    model, opt = _small(ctx)
    for _ in range(5):
        _small_step(model, opt)
    if ctx.task_index == raiser:
        raise ValueError(f"worker {raiser}'s real cause")
    return opt.global_step


def _raise_between_collectives(rank: int, world_size: int) -> int:
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        raise ValueError("rank one's real cause")
    dist.all_reduce(t)
    return rank


def _faults(trials: int, quick: bool = False) -> dict[str, Any]:
    """The fault scenarios (``quick``: one worker each, fewer steps: every process start costs
    seconds). The shard restart and the late worker share one cluster (the late worker joins
    after the restart)."""
    out: dict[str, Any] = {}
    workers = 1 if quick else 2
    with tempfile.TemporaryDirectory() as d:
        every, steps, kill_at = (3, 8, 4) if quick else (10, 60, 25)
        ckpt = os.path.join(d, "ckpt")
        with LocalCluster(
            _restart_fn,
            workers,
            1,
            (steps, kill_at, d),
            timeout=600,
            rpc_timeout=60,
            checkpoint_dir=ckpt,
            checkpoint_every=every,
            max_restarts=1,
        ) as c:
            c.start()
            deadline = time.monotonic() + 300
            while not (Path(d) / "ready").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            added = time.time()
            c.add_worker()
            r = c.wait()
        in_flight = sum(w["lost"] for w in r.worker_results)
        sent = sum(w["steps"] for w in r.worker_results)
        rolled_back = sent - r.stats.global_step - r.stats.refused_commits - in_flight
        out["shard_restart"] = {
            "kill_to_resume_s": r.worker_results[0]["resume_s"],
            "accepted_commits_rolled_back": rolled_back,
            "commits_lost_in_flight": in_flight,
            "checkpoint_every": every,
            "workers": workers,
            "restarts": r.stats.shard_restarts,
        }
        print(
            f"  shard restart: killed -> resumed {out['shard_restart']['kill_to_resume_s']:.2f} s;"
            f" {rolled_back} accepted commits rolled back (checkpoint_every={every}), "
            f"{in_flight} in flight lost ({workers} worker(s))",
            flush=True,
        )
        late = r.worker_results[workers]
        out["late_worker"] = {
            "add_to_first_commit_s": late["first_commit"] - added,
            "join_to_first_commit_s": late["first_commit"] - late["joined"],
        }
        print(
            f"  late worker (after the restart): add_worker() -> first commit "
            f"{late['first_commit'] - added:.2f} s (process start included; "
            f"{late['first_commit'] - late['joined']:.2f} s from its join)",
            flush=True,
        )
    c = LocalCluster(_raise_after_commits, workers, 1, timeout=600, rpc_timeout=60)
    with c:
        c.start()
        os.kill(c.pid(f"worker {workers - 1}"), signal.SIGKILL)
        t = time.monotonic()
        try:
            c.wait()
            seen = "no error"
        except WorkerStartupError as exc:
            seen = str(exc).splitlines()[0]
        out["startup_death"] = {"time_to_fail_s": time.monotonic() - t, "error": seen}
    print(
        f"  worker killed during start-up: the run failed after "
        f"{out['startup_death']['time_to_fail_s']:.2f} s: {seen}",
        flush=True,
    )

    hits = {"launch.spawn": 0, "agn.spawn": 0}
    raisers = 1 if quick else 3  # quick: the only worker raises (no others to outshout it)
    for _ in range(trials):
        try:
            launch_spawn(_raise_between_collectives, 2, timeout=300, num_threads=1)
        except RankFailedError as exc:
            hits["launch.spawn"] += isinstance(exc.__cause__, ValueError) and exc.rank == 1
        try:
            spawn(
                _raise_after_commits,
                raisers,
                args=(raisers // 2,),
                timeout=300,
                rpc_timeout=60,
                num_threads=1,
            )
        except RankFailedError as exc:
            named = exc.name == f"worker {raisers // 2}"
            hits["agn.spawn"] += isinstance(exc.__cause__, ValueError) and named
    out["real_cause"] = {"trials": trials, **hits}
    print(
        f"  real cause seen by the caller: launch.spawn {hits['launch.spawn']}/{trials}, "
        f"agn.spawn {hits['agn.spawn']}/{trials}",
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def _round_trip_figures(t: dict[str, list[float]], shm: bool, stream: bool) -> dict[str, Any]:
    """Medians and paired ratios of one round-trip configuration: per repetition, a commit
    over its floor (that transport's echo + the step + the reply copy of the same
    repetition), over the echo, and p2p over rpc."""
    floor = {
        k: [e + s + c for e, s, c in zip(t[f"{k}_echo"], t["floor_step"], t["floor_copy"])]
        for k in ("p2p", "rpc")
    }

    def paired(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b))

    return {
        "p2p_buffers": "shared memory" if shm else "gloo pair (as across machines)",
        "p2p_commits": "streamed in chunks" if stream else "whole",
        "median_ms": {k: _median_ms(v) for k, v in t.items()},
        "min_ms": {k: 1e3 * min(v) for k, v in t.items()},
        "p2p_floor_ms": _median_ms(floor["p2p"]),
        "rpc_floor_ms": _median_ms(floor["rpc"]),
        "p2p_commit_over_floor": paired(t["p2p_commit"], floor["p2p"]),
        "rpc_commit_over_floor": paired(t["rpc_commit"], floor["rpc"]),
        "p2p_commit_over_p2p_echo": paired(t["p2p_commit"], t["p2p_echo"]),
        "rpc_commit_over_rpc_echo": paired(t["rpc_commit"], t["rpc_echo"]),
        "p2p_commit_over_rpc_commit": paired(t["p2p_commit"], t["rpc_commit"]),
        "p2p_echo_over_rpc_echo": paired(t["p2p_echo"], t["rpc_echo"]),
    }


def main() -> None:
    bench = Bench(
        __file__,
        __doc__,
        quick="a smoke run: one configuration, few repetitions, one cluster (no faults "
        "unless --only faults)",
    )
    ap = bench.parser
    ap.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    ap.add_argument("--reps", type=int, default=None, help="round trips per configuration")
    ap.add_argument("--seconds", type=float, default=None, help="throughput phase length")
    ap.add_argument("--trials", type=int, default=None, help="real-cause trials per launcher")
    args = bench.parse()
    sections = args.only or list(SECTIONS)
    reps = args.reps or (2 if args.quick else 20)
    seconds = args.seconds or (0.2 if args.quick else 5.0)
    trials = args.trials or (1 if args.quick else 6)
    configs = ((1, True, False),)  # (shards, shared memory, streamed commits)
    if not args.quick:
        configs += ((2, True, False), (1, False, False), (1, True, True), (1, False, True))
    worker_counts = (1,) if args.quick else (1, 2, 4)
    out_path = bench.out
    results: dict[str, Any] = {}
    if args.only and out_path.exists():  # keep the other sections of the last full run
        results = json.loads(out_path.read_text())
    results["machine"] = machine()
    results["model"] = "MLP 784-1000-2000-1000-10 (float32, 4,798,010 parameters)"
    loads = results.setdefault("loadavg", {})
    both: dict[str, Any] = {}  # --quick: the round trip and the throughput from one cluster
    both_start: list[float] = []
    if args.quick and {"round_trip", "throughput"} <= set(sections):
        both_start = load()
        both = _run_dual(1, 1, "both", (reps, seconds, "passes" in sections))[0]
    if "passes" in sections:
        start = both_start if both else load()
        print("passes over the 19.2 MB payload, one thread, medians:", flush=True)
        if both:
            results["passes_ms"] = both["passes"]
        else:
            results["passes_ms"] = _passes(reps if args.quick else max(5, reps))
        for k, v in results["passes_ms"].items():
            print(f"  {k:32s} {v:7.2f} ms", flush=True)
        loads["passes"] = {"start": start, "end": load()}

    if "round_trip" in sections:
        start = both_start if both else load()
        print(f"round trip, {reps} reps, shuffled per rep:", flush=True)
        rt: dict[str, Any] = {}
        for num_ps, shm, stream in configs:
            key = f"{num_ps}ps" + ("" if shm else "_pair") + ("_streamed" if stream else "")
            if both:
                out = both["round_trip"]
            else:
                out = _run_dual(1, num_ps, "round_trip", (reps,), shm=shm, stream=stream)[0]
            rt[key] = r = _round_trip_figures(out["times"], shm, stream)
            med = r["median_ms"]
            print(
                f"  {num_ps} shard(s), p2p {r['p2p_buffers']}, commits {r['p2p_commits']}: "
                f"p2p commit {med['p2p_commit']:.1f} ms, its floor {r['p2p_floor_ms']:.1f} (echo "
                f"{med['p2p_echo']:.1f} + step {med['floor_step']:.1f} + reply copy "
                f"{med['floor_copy']:.1f}), rpc commit {med['rpc_commit']:.1f}; paired: p2p "
                f"commit/floor {r['p2p_commit_over_floor']:.2f}x (target <= 1.15), rpc "
                f"commit/floor {r['rpc_commit_over_floor']:.2f}x, p2p commit/echo "
                f"{r['p2p_commit_over_p2p_echo']:.2f}x, p2p/rpc commit "
                f"{r['p2p_commit_over_rpc_commit']:.2f}x",
                flush=True,
            )
            results["params"] = out["params"]
        results["round_trip"] = rt
        loads["round_trip"] = {"start": start, "end": load()}

    if "throughput" in sections:
        start = both_start if both else load()
        print(f"commits/s, phases of {seconds:g} s (p2p, rpc, rpc, p2p):", flush=True)
        tp: dict[str, Any] = {}
        for w in worker_counts:
            outs = [both["throughput"]] if both else _run_dual(w, 1, "throughput", (seconds,))
            per = {"p2p": [], "rpc": []}
            for phase in range(4):
                rows = [o[phase] for o in outs]
                span = max(r["end"] for r in rows) - min(r["start"] for r in rows)
                per[rows[0]["kind"]].append(sum(r["n"] for r in rows) / span)
            tp[f"{w}w"] = {
                "p2p_commits_per_s": statistics.mean(per["p2p"]),
                "rpc_commits_per_s": statistics.mean(per["rpc"]),
                "p2p_over_rpc": statistics.mean(per["p2p"]) / statistics.mean(per["rpc"]),
                "phases": per,
            }
            x = tp[f"{w}w"]
            print(
                f"  {w} worker(s): p2p {x['p2p_commits_per_s']:.1f}/s, rpc "
                f"{x['rpc_commits_per_s']:.1f}/s, p2p/rpc {x['p2p_over_rpc']:.2f}x (target >= 1)",
                flush=True,
            )
        results["commits_per_s"] = tp
        loads["throughput"] = {"start": start, "end": load()}

    if "faults" in sections and args.quick and not args.only:
        sections.remove("faults")  # ten process starts: three times the rest of a quick run
        print("faults: not in a quick run (python benchmarks/agn.py --quick --only faults)")
    if "faults" in sections:
        start = load()
        print("faults (p2p):", flush=True)
        results["faults"] = _faults(trials, args.quick)
        loads["faults"] = {"start": start, "end": load()}

    for name in sections:
        print(f"load average during {name}: {loads[name]['start']} -> {loads[name]['end']}")
    bench.save(results, indent=2)


if __name__ == "__main__":
    main()
