"""What each process of a run does: the training loop and the roles around it.

Owns: the loop every worker runs (the same for every algorithm), the epoch's batches, a rank
of a ``collective`` algorithm (:func:`collective_rank`), a process of a ``server`` algorithm's
cluster -- a shard that serves or a worker that trains (:func:`cluster_role`) -- and the two
pool tasks that run them in the pool's processes (:func:`collective_task`,
:func:`server_task`).

What a worker trains is the command's workload (:mod:`distoptim.cli.workloads`): the MLP on
disjoint shards of a classification dataset, or the GPT on disjoint shards of Shakespeare's
windows; either way an epoch is the same data for every algorithm, and the loop is the same::

    opt.zero_grad(); loss = workload.loss(model, x, y); loss.backward(); opt.step()

Stragglers (``--straggler W:FACTOR``): worker ``W``'s steps take ``FACTOR`` times as long. After
each ``opt.step()`` -- at the step boundary -- that worker sleeps ``(FACTOR - 1)`` times the
compute time of the step it just took: its forward and backward pass plus the inner torch
optimizer's ``step()`` (timed with the optimizer's public step hooks), so its compute runs at
``1/FACTOR`` of its own speed while its arithmetic is unchanged. Communication is not part of
the measured time (a slower machine does not make the network slower, and for the synchronous
algorithms it includes waiting for the other workers). The sleep emulates compute time; it is
not synchronization. On a machine with fewer cores than processes the others may use the
sleeping worker's core meanwhile (a real slow machine would not give its core away).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from distoptim.cli import algorithms
from distoptim.cli.datasets import Dataset
from distoptim.cli.model import load_parameters
from distoptim.cli.progress import Reporter
from distoptim.cli.runconfig import RunConfig, straggler_factor
from distoptim.cli.workloads import Workload, as_workload

__all__ = [
    "PoolContext",
    "cluster_role",
    "collective_rank",
    "collective_task",
    "server_task",
    "train_loop",
    "use_link",
]

PoolContext = tuple[Workload | Dataset, Any, str | None]
"""What every pool process receives once: the workload (or a plain classification dataset),
the progress queue (or None) and the emulated link (``Link.to_env()`` text, or None)."""


def train_loop(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    cfg: RunConfig,
    data: Workload | Dataset,
    rank: int,
    reporter: Reporter,
    evaluator: Callable[[], tuple[float, float]] | None,
    inner: torch.optim.Optimizer | None = None,
    finish: Callable[[], None] | None = None,
) -> int:
    """Run every local step; report progress; ``evaluator`` (on one worker) scores as it goes.

    The workers without an evaluator report a ``mark`` at the evaluation steps when their
    reporter counts bytes (``collective`` runs). A straggler (``cfg.stragglers``) waits after
    each step (module doc); ``inner`` is the torch optimizer whose ``step()`` counts as its
    compute (None: ``opt`` itself). ``finish`` (every worker, or none) runs after the last
    step and before the ``finish`` event, so its time and bytes are the run's. Returns the
    number of local steps taken.
    """
    workload = as_workload(data)
    total = workload.total_steps(cfg)
    eval_every = max(1, total // cfg.eval_points)
    tick_every = max(1, total // 50)
    slow = straggler_factor(cfg.stragglers, rank)

    def score() -> None:
        if evaluator is not None:
            reporter.evaluation(*evaluator())
        elif reporter.sent is not None:
            reporter.mark()

    step = 0
    with _timed_steps(inner if inner is not None else opt, slow > 1) as stepping:
        reporter.start()
        score()
        for xb, yb in workload.batches(cfg, rank):
            began = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = workload.loss(model, xb, yb)
            loss.backward()
            forward_backward = time.perf_counter() - began
            stepping[0] = 0.0
            opt.step()
            if slow > 1:  # emulated compute time, not synchronization
                time.sleep((slow - 1) * (forward_backward + stepping[0]))
            step += 1
            reporter.step(workload.amount(xb), loss.item())
            if step % tick_every == 0 or step == total:
                reporter.tick()
            if step % eval_every == 0 and step != total:
                score()
        if finish is not None:
            finish()
        reporter.finish()
    return step


@contextlib.contextmanager
def _timed_steps(opt: torch.optim.Optimizer, on: bool) -> Iterator[list[float]]:
    """While inside, ``[seconds]``: the time ``opt.step()`` took since the caller last set it to
    0 (torch's public step pre/post hooks; nothing is hooked unless ``on``)."""
    spent = [0.0]
    if not on:
        yield spent
        return
    began = [0.0]

    def pre(*_: Any) -> None:
        began[0] = time.perf_counter()

    def post(*_: Any) -> None:
        spent[0] += time.perf_counter() - began[0]

    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    try:
        yield spent
    finally:
        for h in handles:
            h.remove()


def _model_and_optimizer(
    cfg: RunConfig, workload: Workload, cluster: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The seeded model, the torch optimizer (inner) and the algorithm's optimizer around it."""
    model = workload.build_model(cfg)
    inner = algorithms.make_torch_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    return model, inner, algorithms.get(cfg.algo).build(inner, cfg, cluster)


def collective_rank(
    rank: int,
    world_size: int,
    cfg: RunConfig,
    data: Workload | Dataset,
    sink: Any,
    run: int | None,
) -> dict[str, Any]:
    """One rank of a ``collective`` algorithm, in an initialized default process group.

    Returns its progress events and communication counters; rank 0 also the run's final model
    (the parameters the algorithm's ``model`` names: sync's parameters, which every rank
    shares, or the DiLoCo family's global copy, read after the algorithm's ``finish``, so it
    includes the inner steps after the last periodic sync). Rank 0 evaluates that model as it
    goes.
    """
    import torch.distributed as dist

    workload = as_workload(data)
    model, inner, opt = _model_and_optimizer(cfg, workload, None)  # same seed everywhere
    algo = algorithms.get(cfg.algo)
    reporter = Reporter(sink, rank, run, sent=lambda: opt.comm_stats.bytes_sent)
    scratch = workload.build_model(cfg)

    def score() -> tuple[float, float]:
        load_parameters(scratch, algo.model(opt, model))
        return workload.evaluate(scratch)

    dist.barrier()  # the clock starts when every rank is ready
    evaluator = score if rank == 0 else None
    finish = None if algo.finish is None else functools.partial(algo.finish, opt)
    steps = train_loop(model, opt, cfg, workload, rank, reporter, evaluator, inner, finish)
    stats = opt.comm_stats
    final = [t.detach().clone() for t in algo.model(opt, model)] if rank == 0 else None
    return {
        "events": reporter.events,
        "steps": steps,
        "params": final,
        "collectives": int(stats.collectives),
        "syncs": int(getattr(opt, "syncs", stats.collectives)),
        "bytes_sent": int(stats.bytes_sent),
    }


def _train_on_cluster(
    cluster: Any, cfg: RunConfig, workload: Workload, sink: Any, run: int | None
) -> list[dict[str, Any]]:
    """A worker of a ``server`` algorithm: seed or pull the center, train; return its events."""
    model, inner, opt = _model_and_optimizer(cfg, workload, cluster)
    hook = opt.make_session_run_hook(cluster.is_chief, cluster.task_index)
    hook.begin()
    hook.after_create_session()  # chief seeds the center; the others wait for it and pull
    reporter = Reporter(sink, cluster.task_index, run)
    evaluator = None
    if cluster.is_chief:
        scratch = workload.build_model(cfg)

        def evaluator() -> tuple[float, float]:
            load_parameters(scratch, opt.center_variables())
            return workload.evaluate(scratch)

    train_loop(model, opt, cfg, workload, cluster.task_index, reporter, evaluator, inner)
    return reporter.events


def cluster_role(
    cfg: RunConfig, data: Workload | Dataset, sink: Any, run: int | None
) -> tuple[str, Any]:
    """This process's part of a ``server`` algorithm's cluster (torchrun's environment).

    The first ``cfg.num_ps`` ranks serve until every worker is done and return
    ``("shard", ShardReport)``; the others train and return ``("worker", events)``. The
    cluster uses ``cfg.transport``; it is left (and the transport shut down) before returning,
    also on an error.
    """
    from distoptim.agn import Cluster

    reused = _rpc_in_a_reused_process() if cfg.transport == "rpc" else contextlib.nullcontext()
    with reused:
        cluster = Cluster.from_env(num_ps=cfg.num_ps, transport=cfg.transport)
        if cluster.is_ps:
            try:
                return "shard", cluster.serve(timeout=cfg.timeout)
            finally:
                cluster.shutdown()
        ok = False
        try:
            events = _train_on_cluster(cluster, cfg, as_workload(data), sink, run)
            ok = True
        finally:
            cluster.shutdown(failed=not ok)
        return "worker", events


@contextlib.contextmanager
def _rpc_in_a_reused_process() -> Iterator[None]:
    """What torch's RPC transport (``--transport rpc``) needs to run a cluster in a process
    that ran others before (the ``p2p`` transport, the default, needs neither).

    Two pieces of per-process torch state, both private, both pinned by
    ``tests/cli/test_training.py``:

    * ``torch.distributed.rpc._init_counter``: ``init_rpc`` prefixes its store keys with the
      number of earlier ``init_rpc`` calls in the process (``rpc_prefix_<k>``). The processes
      of one run must agree on it or their rendezvous never meets (a pool process that served
      three clusters and a fresh one wait for each other forever). Each run has a fresh store,
      so 0 is never stale: it is reset to 0.
    * torch's C++ log level at ERROR while inside (unless the user set ``TORCH_CPP_LOG_LEVEL``):
      TensorPipe logs a warning for every connection a finished peer closes, which at a normal
      end says nothing. torch reads ``TORCH_CPP_LOG_LEVEL`` once, when it loads, into libc10's
      ``FLAGS_caffe2_log_level`` (0 INFO, 1 WARNING, 2 ERROR); a pool process loaded torch long
      before, so this sets that flag and restores it on exit. Where it is missing: nothing.
    """
    rpc = sys.modules.get("torch.distributed.rpc")  # not imported: nothing to reset
    if rpc is not None and hasattr(rpc, "_init_counter"):
        with rpc._init_counter_lock:
            rpc._init_counter = 0
    flag = None if "TORCH_CPP_LOG_LEVEL" in os.environ else _cpp_log_level_flag()
    if flag is None:
        yield
        return
    before = flag.value
    flag.value = max(before, 2)
    try:
        yield
    finally:
        flag.value = before


def _cpp_log_level_flag() -> ctypes.c_int | None:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# pool tasks: fn(context, *args) in a pool process (distoptim.cli.pool)
# ---------------------------------------------------------------------------------------------
def use_link(link_env: str | None) -> None:
    """Emulate the link ``link_env`` (``Link.to_env()`` text) in this process; None: none."""
    from distoptim.comm.link import Link, set_link

    set_link(None if link_env is None else Link.from_env(link_env))


def collective_task(context: PoolContext, cfg: RunConfig, run: int) -> dict[str, Any]:
    """A rank of a ``collective`` run: its process group from the task's torchrun variables."""
    from distoptim.launch import torchrun_main

    data, sink, link_env = context
    use_link(link_env)
    return torchrun_main(collective_rank, cfg, data, sink, run, backend="gloo", timeout=cfg.timeout)


def server_task(context: PoolContext, cfg: RunConfig, run: int) -> tuple[str, Any]:
    """A shard or worker of a ``server`` run: :func:`cluster_role` in the task's cluster."""
    data, sink, link_env = context
    use_link(link_env)
    return cluster_role(cfg, data, sink, run)
