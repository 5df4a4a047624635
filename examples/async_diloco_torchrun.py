"""Asynchronous DiLoCo on a parameter server, under torchrun or locally.

The first ``--num-ps`` ranks are parameter-server shards; the others are workers (rank
``num_ps`` is the chief, task 0). Each worker trains the same MLP on its own shard of a synthetic
classification set (Gaussian blobs) with AdamW (the inner optimizer) and, every ``--period``
steps, commits its pseudo-gradient ``θ_pulled - θ``; the shard applies the outer optimizer --
Nesterov SGD, lr 0.7, momentum 0.9, built on the shard from a picklable factory -- and replies
with the new center. Nobody waits for anybody. By default the outer optimizer is Delayed
Nesterov (``--delayed-momentum n``: momentum updated once every N = the number of workers
commits; ``0`` applies Nesterov to every commit, which is fragile at lr 0.7, momentum 0.9) and
each worker takes a number of local steps proportional to its measured speed (Dynamic Local
Updates; ``--no-dylu`` turns it off); ``--straggler T:F`` makes worker T's steps F times slower
so DyLU has something to do. Each process prints whole lines (one write each), so the lines of
processes that share a terminal never run together.

Under torchrun, one node: 1 PS + 3 workers::

    torchrun --standalone --nproc-per-node 4 examples/async_diloco_torchrun.py --straggler 2:3

Several nodes: on node n (address HOSTn; ``is_host=true`` on node 0 only; rank 0, the PS, lands
on the node whose address sorts first; ``docs/multinode.md`` says why each flag)::

    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true --local-addr HOSTn \\
        examples/async_diloco_torchrun.py

Locally without torchrun (``distoptim.agn.spawn``: the same code path, local processes)::

    python examples/async_diloco_torchrun.py --local 3 --straggler 2:3
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import distoptim
from distoptim.agn import Cluster, spawn

OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)  # picklable


def _blobs(n: int = 4096, classes: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification task: each point is drawn around the center of its class."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, 16, generator=g)
    y = torch.randint(classes, (n,), generator=g)
    return centers[y] + 1.2 * torch.randn(n, 16, generator=g), y


def _model() -> nn.Module:
    torch.manual_seed(0)  # the chief's initial values seed the center; the others pull it
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))


def train(ctx: Cluster, args: argparse.Namespace) -> dict:
    """One worker's loop; returns its commits, last DyLU period and the center's accuracy."""
    x, y = _blobs()
    xs, ys = x[ctx.task_index :: ctx.num_worker], y[ctx.task_index :: ctx.num_worker]
    model = _model()
    opt = distoptim.AsyncDiLoCoOptimizer(
        torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.01),
        ctx.num_worker,
        ctx.custom_getter,
        communication_period=args.period,
        outer_optimizer=OUTER,
        delayed_momentum=ctx.num_worker if args.delayed_momentum == "n" else args.delayed_momentum,
        dynamic_local_updates=args.dylu,
    )
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()
    slow, factor = args.straggler or (-1, 1.0)
    g = torch.Generator().manual_seed(ctx.task_index)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        idx = torch.randint(len(xs), (64,), generator=g)
        if step % 2:  # PyTorch path
            opt.zero_grad()
            F.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
        else:  # TF path
            opt.minimize(lambda idx=idx: F.cross_entropy(model(xs[idx]), ys[idx]))
        if ctx.task_index == slow:  # this worker's steps take `factor` times as long
            time.sleep((factor - 1.0) * (time.perf_counter() - t0))
    center = _model()
    with torch.no_grad():
        for p, c in zip(center.parameters(), opt.center_variables()):
            p.copy_(c)
        accuracy = float((center(x).argmax(1) == y).float().mean())
    return {"commits": opt.commits, "period": opt.period, "accuracy": accuracy}


def _say(line: str) -> None:
    """Print ``line`` with one write of the whole line (a line up to 4 KiB reaches a pipe or a
    terminal in one piece, even when other processes write to it too)."""
    os.write(1, (line + "\n").encode())


def _delayed_momentum(text: str) -> int | str:
    """``n`` (the number of workers) or an integer ``N >= 0``."""
    if text.strip().lower() == "n":
        return "n"
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give 'n' or an integer >= 0")
    return value


def _straggler(text: str) -> tuple[int, float]:
    task, _, factor = text.partition(":")
    return int(task), float(factor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-ps", type=int, default=1, help="parameter-server shards")
    ap.add_argument("--steps", type=int, default=400, help="steps per worker")
    ap.add_argument("--period", type=int, default=20, help="H, local steps between commits")
    ap.add_argument(
        "--delayed-momentum",
        type=_delayed_momentum,
        default="n",
        metavar="n|N",
        help="Delayed Nesterov: the outer momentum every N commits; n: the number of workers "
        "(default); 0: Nesterov on every commit (fragile)",
    )
    ap.add_argument(
        "--dylu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Dynamic Local Updates (default on)",
    )
    ap.add_argument("--straggler", type=_straggler, default=None, metavar="TASK:FACTOR")
    ap.add_argument("--local", type=int, default=0, metavar="N", help="spawn N local workers")
    ap.add_argument("--transport", choices=("p2p", "rpc"), default="p2p", help="worker <-> PS")
    args = ap.parse_args()

    if args.local:
        result = spawn(
            train, args.local, num_ps=args.num_ps, args=(args,), transport=args.transport
        )
        for task, out in enumerate(result.worker_results):
            _say(f"worker {task}: {out}")
        _say(f"commits per worker (server): {result.stats.commits_per_worker}")
        return

    cluster = Cluster.from_env(num_ps=args.num_ps, transport=args.transport)
    if cluster.is_ps:
        report = cluster.serve()
        cluster.shutdown()
        _say(f"[ps {report.shard}] done: commits {report.stats.commits_per_worker}")
        return
    with cluster:  # tells the shards this worker finished (or failed), then leaves
        out = train(cluster, args)
    _say(f"[worker {cluster.task_index}] {out}")


if __name__ == "__main__":
    main()
