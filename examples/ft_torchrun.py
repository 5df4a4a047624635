"""Fault-tolerant training on torchft: replica groups that die and join while the job goes on.

A *replica group* is one torchrun job (here 2 processes: CrossShardOptimizer's group within the
replica, or DDP's with ``--algo diloco``); replica groups find each other through a torchft
lighthouse and average across groups through a ``torchft.Manager``, step by step
(``--algo sync``) or sync by sync (``--algo diloco``). Kill a replica group and start it again:
the others go on, and the new one heals from a peer and joins them. Every process prints its
committed steps, and at the end the bitwise checksum of the model, which is the same in every
replica group that finished.

On one machine (three terminals)::

    distoptim lighthouse --min-replicas 1 --port 29510
    torchrun --standalone --nproc-per-node 2 examples/ft_torchrun.py \\
        --lighthouse http://localhost:29510 --replica-id 0
    torchrun --standalone --nproc-per-node 2 examples/ft_torchrun.py \\
        --lighthouse http://localhost:29510 --replica-id 1

Across machines: the lighthouse on one of them, one replica group per machine, each told the
address the others reach it at (``--host``) -- see ``docs/fault_tolerance.md``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distoptim
from distoptim.comm.checksum import state_checksum
from distoptim.ft import SlotShards, init_replica_group, make_manager


def _blobs(n: int = 4096, classes: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification task: each point is drawn around the center of its class."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, 16, generator=g)
    y = torch.randint(classes, (n,), generator=g)
    return centers[y] + 1.2 * torch.randn(n, 16, generator=g), y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lighthouse", required=True, help="the lighthouse's http://host:port")
    parser.add_argument("--replica-id", type=int, required=True, help="this group's slot")
    parser.add_argument("--replicas", type=int, default=2, help="replica slots of the job")
    parser.add_argument("--host", default="localhost", help="address peers reach this group at")
    parser.add_argument("--algo", choices=("sync", "diloco"), default="sync")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()

    # the replica group's own processes (torchrun's world), safe across torchrun's restarts
    rank, world = init_replica_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    holder: list[torch.optim.Optimizer] = []

    def state() -> dict:  # what a healing replica group receives (copies)
        opt = holder[0] if args.algo == "sync" else inner
        return {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": opt.state_dict(),
        }

    def load(saved: dict) -> None:
        model.load_state_dict(saved["model"])
        (holder[0] if args.algo == "sync" else inner).load_state_dict(saved["opt"])

    manager = make_manager(
        args.lighthouse,
        replica_id=f"replica_{args.replica_id}",
        state_dict=state,
        load_state_dict=load,
        rank=rank,
        world_size=world,
        store_addr=args.host,  # the group's torchrun store, as the other groups reach it
        store_port=int(os.environ["MASTER_PORT"]),
        host=args.host,
        timeout=10,
        init_sync=False,
    )
    net: nn.Module = model
    if args.algo == "sync":
        opt = distoptim.CrossShardOptimizer(inner, manager=manager)
    else:  # DDP keeps the group's processes one model; DiLoCo runs across the groups
        net = nn.parallel.DistributedDataParallel(model)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        opt = distoptim.DiLoCo(inner, outer, sync_every=20, manager=manager, model=net)
    holder.append(opt)
    x, y = _blobs()
    # every process of every replica group reads its own part of each epoch, by slot
    shards = SlotShards(len(x), args.replicas * world, args.replica_id * world + rank, 16)
    while opt.iterations < args.steps:
        idx = shards.batch(opt.iterations)
        opt.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
        if rank == 0 and opt.iterations % 100 == 0:
            stats = opt.replica_stats
            print(
                f"[replica {args.replica_id}] step {opt.iterations} commits {stats.commits} "
                f"heals {stats.heals}",
                flush=True,
            )
    if args.algo == "diloco":
        opt.finish()  # the model is the global copy on every replica group
    if rank == 0:
        print(
            f"[replica {args.replica_id}] done at step {opt.iterations}: model checksum "
            f"{state_checksum(list(model.parameters())):016x}",
            flush=True,
        )
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
