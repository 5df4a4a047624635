"""One run, from :class:`~distoptim.cli.runconfig.RunConfig` to :class:`RunRecord`.

Owns: running a configuration on local processes of a :class:`~distoptim.cli.pool.ProcessPool`
(:func:`run_on_pool`), or as this process's rank of a torchrun job (:func:`run_torchrun`), and
assembling the record from what the processes return.

Locally, a run takes the first ``k`` processes of the pool (``k`` = workers, plus the
parameter-server shards for a ``server`` algorithm), a fresh rendezvous ``TCPStore`` on a free
loopback port, and the environment torchrun would give each rank
(:func:`distoptim.launch.torchrun_env`): the same code path as a torchrun job, so the two
cannot drift apart.

Under torchrun (multi-node), one process per rank; on node n, address HOSTn (``is_host=true``
on node 0 only; ``docs/multinode.md`` says why each flag is needed)::

    GLOO_SOCKET_IFNAME=eth0 TP_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 4 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true \\
        --local-addr HOSTn -m distoptim.cli.train --algo sync --epochs 30 --out results/

With a ``server`` algorithm the first ``--num-ps`` ranks are parameter-server shards and the
rest are workers (8 processes, ``--num-ps 1``: 7 workers); the chief (the first worker) writes
the outputs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from distoptim.cli import algorithms
from distoptim.cli.datasets import Dataset
from distoptim.cli.pool import ProcessPool, Task
from distoptim.cli.record import RunRecord, finish_record, record_collective, record_server
from distoptim.cli.runconfig import RunConfig
from distoptim.cli.training import cluster_role, collective_rank, collective_task, server_task
from distoptim.launch import (
    ProcessTimeoutError,
    RankFailedError,
    from_bytes,
    to_bytes,
    torchrun_env,
    torchrun_main,
)

__all__ = ["run_on_pool", "run_torchrun"]


def run_on_pool(cfg: RunConfig, run: int, pool: ProcessPool, data: Dataset) -> RunRecord:
    """Train once on the first processes of ``pool``; raises what the pool raises.

    ``run``: this run's index, carried by its progress events. ``data`` must be the dataset
    the pool's processes hold (the final model is scored on it here).
    """
    import torch.distributed as dist

    family = algorithms.get(cfg.algo).family
    k = algorithms.processes_of(cfg)
    threads = max(1, (os.cpu_count() or 1) // k)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fn = collective_task if family == "collective" else server_task
    tasks = [
        Task(fn, (cfg, run), torchrun_env(r, k, store.port), threads, cfg.seed) for r in range(k)
    ]
    if family == "collective":
        names = [f"rank {r}" for r in range(k)]
    else:
        names = [f"ps {s}" for s in range(cfg.num_ps)] + [f"worker {t}" for t in range(cfg.workers)]
    submitted = time.time()
    try:
        outcomes = pool.run(
            tasks, timeout=cfg.timeout, names=names, fail_fast=family == "collective"
        )
    except ProcessTimeoutError as exc:  # the user's limit: say so before suspecting a hang
        raise ProcessTimeoutError(exc.timeout, exc.pending, limit="--timeout") from None
    finally:
        del store
    record = RunRecord(cfg)
    if family == "collective":
        events, final = record_collective(record, [o.value for o in outcomes])
    else:
        for o in outcomes:  # a worker that raised ended alone; report it once all are done
            if not o.ok:
                raise RankFailedError(o.index, o.name, o.headline(), o.error) from o.exception
        events, final = _server_outcome(record, [o.value for o in outcomes], submitted)
    t0 = finish_record(record, data, events, final)
    if t0 is not None:
        record.startup_s = max(0.0, t0 - submitted)
        record.overhead_s = max(0.0, time.time() - submitted - (record.wall_time_s or 0.0))
    return record


def _server_outcome(
    record: RunRecord, roles: Sequence[tuple[str, Any]], since: float
) -> tuple[list, list]:
    """Merge the shards' reports into ``record``; returns (events, the final center)."""
    from distoptim.agn.cluster import merge_reports

    cfg = record.config
    reports = [v for kind, v in roles if kind == "shard"]
    events: list[list[dict[str, Any]] | None] = [v for kind, v in roles if kind == "worker"]
    stats, centers, _ = merge_reports(reports, cfg.workers, time.time() - since)
    center = next(iter(centers.values()))
    return record_server(record, stats, events, center), center


# ---------------------------------------------------------------------------------------------
# torchrun: this process is one rank
# ---------------------------------------------------------------------------------------------
def _collective_gathered(
    rank: int, world_size: int, cfg: RunConfig, data: Dataset, sink: Any
) -> list[dict[str, Any]] | None:
    """Under torchrun: train, then gather every rank's counters and events on rank 0."""
    import torch.distributed as dist

    out = collective_rank(rank, world_size, cfg, data, sink, None)
    params = out.pop("params")
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, out)
    if rank != 0:
        return None
    gathered[0]["params"] = params
    return gathered


def run_torchrun(cfg: RunConfig, data: Dataset, sink: Any = None) -> RunRecord | None:
    """This process is one rank of a torchrun job: train; the reporting rank returns the record.

    ``collective``: every rank trains in torchrun's process group (gloo: the model lives on
    the CPU); rank 0 returns the record. ``server``: the first ``cfg.num_ps`` ranks serve as
    parameter-server shards and the others are workers; the chief (worker 0) returns the
    record. ``sink``: where the reporting rank's progress events go. The emulated link, if
    any, comes from ``DISTOPTIM_LINK`` in torchrun's environment.
    """
    if algorithms.get(cfg.algo).family == "server":
        return _torchrun_server(cfg, data, sink)
    rank = int(os.environ.get("RANK", "0"))
    outs = torchrun_main(
        _collective_gathered,
        cfg,
        data,
        sink if rank == 0 else None,
        backend="gloo",
        timeout=cfg.timeout,
    )
    if outs is None:
        return None
    record = RunRecord(cfg)
    events, final = record_collective(record, outs)
    finish_record(record, data, events, final)
    return record


def _torchrun_server(cfg: RunConfig, data: Dataset, sink: Any) -> RunRecord | None:
    """One rank of a parameter-server torchrun job; the chief gathers what it reports.

    The shards' reports and the workers' progress events reach the chief through torchrun's
    rendezvous store (``MASTER_ADDR:MASTER_PORT``): each worker puts its events there after it
    left the cluster, each shard its report once it stopped serving; the chief waits for them
    (bounded by ``cfg.timeout``).
    """
    import torch.distributed as dist

    from distoptim.agn.cluster import merge_reports

    started = time.time()
    wait = timedelta(seconds=cfg.timeout)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait
    )
    prefix = f"distoptim-cli/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    rank = int(os.environ["RANK"])
    chief = rank == cfg.num_ps
    kind, value = cluster_role(cfg, data, sink if chief else None, None)
    if kind == "shard":
        store.set(f"{prefix}report/{value.shard}", to_bytes(value))
        return None
    store.set(f"{prefix}events/{rank - cfg.num_ps}", to_bytes(value))
    if not chief:
        return None
    keys = [f"{prefix}report/{s}" for s in range(cfg.num_ps)]
    store.wait(keys, wait)
    reports = [from_bytes(store.get(k)) for k in keys]
    stats, centers, _ = merge_reports(reports, cfg.workers, time.time() - started)
    finished = sorted({t for r in reports for t in r.finished_workers})
    keys = [f"{prefix}events/{t}" for t in finished]
    store.wait(keys, wait)
    worker_events = [from_bytes(store.get(k)) for k in keys]
    record = RunRecord(cfg)
    center = next(iter(centers.values()))
    events = record_server(record, stats, worker_events, center)
    finish_record(record, data, events, center)
    return record
