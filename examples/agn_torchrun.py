"""Asynchronous training with AGNOptimizer on a parameter server, under torchrun or locally.

One script for every role: the first ``--num-ps`` ranks become parameter-server shards and
serve; the other ranks are workers (rank ``num_ps`` is the chief, task 0). Each worker trains the
same MLP on its own shard of a synthetic regression set, commits every ``--period`` steps and
never waits for the others. ``--algo downpour`` / ``easgd`` run the baselines instead.

Under torchrun, one node: 1 PS + 2 workers::

    torchrun --standalone --nproc-per-node 3 examples/agn_torchrun.py

Several nodes: on node n (address HOSTn; ``is_host=true`` on node 0 only; rank 0, the PS,
lands on the node whose address sorts first; ``docs/multinode.md`` says why each flag)::

    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true --local-addr HOSTn \\
        examples/agn_torchrun.py --num-ps 2

(``--transport rpc``: torch.distributed.rpc instead of the default p2p transport; across nodes
it needs ``TP_SOCKET_IFNAME=eth0`` too.)

Faults (p2p): with ``--checkpoint-dir``, torchrun's own restarts (``--max-restarts 3``) restart
the job and the shards resume from their checkpoints. Workers may also join a running cluster
late: the chief prints the store's address at start; from any machine that reaches it::

    DISTOPTIM_AGN_JOIN=HOST:PORT torchrun --standalone --nproc-per-node 2 \
        examples/agn_torchrun.py

(every process of that job is a worker; it pulls the current center and commits like the
others). A worker that leaves or dies is dropped without stalling anyone.

Locally without torchrun (``distoptim.agn.spawn``: same code path, local processes); with
``--restarts R`` a shard that dies is restarted from its checkpoint while the workers wait::

    python examples/agn_torchrun.py --local 2
    python examples/agn_torchrun.py --local 2 --checkpoint-dir /tmp/ps --restarts 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import distoptim
from distoptim.agn import Cluster, spawn


def _say(line: str) -> None:
    """Print ``line`` in one write: several processes share torchrun's stdout, and ``print``
    writes the text and its newline apart, so another process's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _dataset(n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = 0.25 * torch.randn(16, 1, generator=g)
    return x, torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)  # the chief's initial values seed the centers; the others pull them
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def _optimizer(algo: str, model: nn.Module, ctx: Cluster, period: int) -> torch.optim.Optimizer:
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if algo == "agn":
        return distoptim.AGNOptimizer(
            inner, ctx.num_worker, ctx.custom_getter, communication_period=period
        )
    if algo == "downpour":
        return distoptim.DownpourOptimizer(inner, ctx.num_worker, ctx.custom_getter, period)
    return distoptim.ElasticAverageOptimizer(inner, ctx.num_worker, ctx.custom_getter, period)


def train(ctx: Cluster, algo: str, steps: int, period: int) -> float:
    """One worker's loop; returns the full-data loss of the center at the end."""
    x, y = _dataset()
    xs, ys = x[ctx.task_index :: ctx.num_worker], y[ctx.task_index :: ctx.num_worker]
    model = _model()
    opt = _optimizer(algo, model, ctx, period)
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()
    g = torch.Generator().manual_seed(ctx.task_index)
    for step in range(1, steps + 1):
        idx = torch.randint(len(xs), (64,), generator=g)
        opt.zero_grad()
        F.mse_loss(model(xs[idx]), ys[idx]).backward()
        opt.step()
        if ctx.is_chief and step % (steps // 5) == 0:
            _say(f"[worker 0] step {step:4d}  global_step {opt.global_step:4d}")
    center = _model()
    with torch.no_grad():
        for p, c in zip(center.parameters(), opt.center_variables()):
            p.copy_(c)
        return float(F.mse_loss(center(x), y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", choices=("agn", "downpour", "easgd"), default="agn")
    ap.add_argument("--num-ps", type=int, default=1, help="parameter-server shards")
    ap.add_argument("--steps", type=int, default=300, help="steps per worker")
    ap.add_argument("--period", type=int, default=10, help="communication_period")
    ap.add_argument("--checkpoint-dir", default=None, help="PS checkpoints (resume on restart)")
    ap.add_argument("--local", type=int, default=0, metavar="N", help="spawn N local workers")
    ap.add_argument("--transport", choices=("p2p", "rpc"), default="p2p", help="worker <-> PS")
    ap.add_argument("--restarts", type=int, default=0, help="--local: restarts of a dead shard")
    args = ap.parse_args()
    fn_args = (args.algo, args.steps, args.period)

    if args.local:
        result = spawn(
            train,
            args.local,
            num_ps=args.num_ps,
            args=fn_args,
            checkpoint_dir=args.checkpoint_dir,
            transport=args.transport,
            max_restarts=args.restarts,
        )
        print(f"center loss per worker: {[round(v, 4) for v in result.worker_results]}")
        print(f"stats: {result.stats.as_dict()}")
        return

    cluster = Cluster.from_env(
        num_ps=args.num_ps, checkpoint_dir=args.checkpoint_dir, transport=args.transport
    )
    if cluster.is_ps:
        report = cluster.serve()
        cluster.shutdown()
        s = report.stats
        _say(
            f"[ps {report.shard}] done: global_step {s.global_step}, commits "
            f"{s.commits_per_worker}, dead workers {s.dead_workers}, "
            f"staleness {s.staleness_histogram}"
        )
        return
    _say(f"[worker {cluster.task_index}] connected to {cluster.num_ps} shard(s)")
    if cluster.is_chief and not cluster.is_late and args.transport == "p2p":
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        _say(f"[worker 0] late workers may join with DISTOPTIM_AGN_JOIN={where}")
    with cluster:  # tells the shards this worker finished (or failed), then leaves
        loss = train(cluster, *fn_args)
    _say(f"[worker {cluster.task_index}] center loss {loss:.4f}")


if __name__ == "__main__":
    main()
