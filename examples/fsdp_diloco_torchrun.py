"""DiLoCo across replica groups that shard their model with FSDP2, on torchft.

A *replica group* is one torchrun job of several processes holding ONE model between them:
``fully_shard`` splits every parameter over the group (``Shard(0)``) and reduces gradients
inside it. DiLoCo runs across the groups: every sync, each process averages its local shard's
pseudo-gradient with its counterpart in every other group (through its ``torchft.Manager``,
which connects rank ``r`` of every group) and applies the outer step to its shard. The global
copy and outer momentum each process keeps are its shard's (1/k of the model per process), and
so are the bytes it sends. At the end EVERY process of every group prints the checksum of the
whole model (gathered over its group): all of them are equal (``docs/groups.md``), and the
full-data loss before and after training.

On one machine, 2 groups x 2 processes (three terminals)::

    distoptim lighthouse --min-replicas 2 --port 29510
    torchrun --nproc-per-node 2 --master-port 29500 examples/fsdp_diloco_torchrun.py \\
        --lighthouse http://localhost:29510 --replica-id 0
    torchrun --nproc-per-node 2 --master-port 29501 examples/fsdp_diloco_torchrun.py \\
        --lighthouse http://localhost:29510 --replica-id 1

A group may also be started with ``--max-restarts N``: torchrun then restarts its workers when
one dies, and they heal from the other groups (``init_replica_group`` keeps a restarted attempt
from meeting the dead one's workers; ``tests/ft/test_torchrun_restart.py``).

On CUDA devices (``--device cuda``: one device per process, ``LOCAL_RANK``'s; NCCL inside the
group and across the groups, through torchft's ``ProcessGroupNCCL``): the same commands with
``--device cuda``, as ``benchmarks/gpu.sh`` runs them on 4 devices.

Across machines: the lighthouse on one of them (``--host`` its address there), one replica
group per machine, each told the address the other groups reach it at (``--host``: its
manager, checkpoint server and torchrun store) and the interface gloo binds
(``GLOO_SOCKET_IFNAME``). The commands, run on network-namespace hosts by
``tests/multihost/test_systems.py``: ``docs/multinode.md``, "Replica groups of FSDP2 shards".
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import distoptim
from distoptim.comm.checksum import state_checksum
from distoptim.ft import SlotShards, init_replica_group, make_manager


def _blobs(n: int = 4096, classes: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification task: each point is drawn around the center of its class."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, 16, generator=g)
    y = torch.randint(classes, (n,), generator=g)
    return centers[y] + 1.2 * torch.randn(n, 16, generator=g), y


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The model's loss on the whole data set (a forward of the group's FSDP2 model: every
    process of the group calls it)."""
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lighthouse", required=True, help="the lighthouse's http://host:port")
    parser.add_argument("--replica-id", type=int, required=True, help="this group's slot")
    parser.add_argument("--replicas", type=int, default=2, help="replica groups of the job")
    parser.add_argument("--host", default="localhost", help="address peers reach this group at")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--width", type=int, default=64, help="the hidden layer's width")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    # the replica group's own processes (torchrun's world), safe across torchrun's restarts
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world = init_replica_group(backend)
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("shard",))
    torch.manual_seed(0)  # every process of every group builds the same model
    model = nn.Sequential(nn.Linear(16, args.width), nn.ReLU(), nn.Linear(args.width, 8))
    model.to(mesh.device_type)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def state() -> dict:  # what a healing process receives from its counterpart (copies)
        return {
            "model": {k: v.to_local().clone() for k, v in model.state_dict().items()},
            "inner": inner.state_dict(),
        }

    def load(saved: dict) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.to_local().copy_(saved["model"][k])
        inner.load_state_dict(saved["inner"])

    manager = make_manager(
        args.lighthouse,
        replica_id=f"replica_{args.replica_id}",
        state_dict=state,
        load_state_dict=load,
        min_replica_size=args.replicas,
        rank=rank,
        world_size=world,
        store_addr=args.host,  # the group's torchrun store, as the other groups reach it
        store_port=int(os.environ["MASTER_PORT"]),
        host=args.host,
        timeout=30,
        init_sync=False,
        backend=backend,
    )
    # the manager says the group has `world` processes; the DTensor parameters say FSDP2 holds
    # one model over them: DiLoCo averages each process's shards across the groups
    opt = distoptim.DiLoCo(inner, outer, sync_every=args.sync_every, manager=manager)
    x, y = (t.to(mesh.device_type) for t in _blobs())
    first = _loss(model, x, y)  # the same on every process: one model, built the same way
    # each group reads its own part of each epoch; its processes split the group's batch
    shards = SlotShards(len(x), args.replicas, args.replica_id, 16 * world)
    began = time.perf_counter()
    while opt.iterations < args.steps:
        idx = shards.batch(opt.iterations)[rank::world]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    opt.finish()  # the model is the global copy on every process of every group
    seconds = time.perf_counter() - began
    last = _loss(model, x, y)
    whole = [p.full_tensor() for p in model.parameters()]  # gathered over the group
    line = (
        f"[replica {args.replica_id} rank {rank}] done at step {opt.iterations}, "
        f"{opt.syncs} syncs, {opt.comm_stats.bytes_sent} bytes sent, full-data loss "
        f"{first:.4f} -> {last:.4f} in {seconds:.2f} s: model checksum "
        f"{state_checksum(whole):016x}"
    )
    # one write, newline included: the group's processes share torchrun's stdout, and an
    # unbuffered print writes the line and its end apart (two ranks' lines would run together)
    print(line + "\n", end="", flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
