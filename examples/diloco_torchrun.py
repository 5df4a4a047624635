"""Low-communication training with DiLoCo, Streaming DiLoCo and LocalSGD, torchrun or locally.

Each rank is one replica: it trains the same MLP on its own shard of a synthetic
classification set (Gaussian blobs) with AdamW (the inner optimizer) and talks to the others
only every ``--sync-every`` steps, when the replicas average their pseudo-gradients
``θ_global - θ_local`` and apply them to the global copy with Nesterov SGD (the outer optimizer,
DiLoCo's settings). ``--fragments 4 --wire int8 --delay 1`` turns it into Streaming DiLoCo: four
fragments sync in turn, in int8, each overlapped with one inner step. ``--algo localsgd`` runs
LocalSGD instead: the same inner AdamW, and every ``--sync-every`` steps the replicas replace
their parameters by their mean (DiLoCo with outer SGD at learning rate 1); ``--algo diloco
localsgd`` runs both in turn on the same ranks and data (a fresh model each; the fragment and
wire options are DiLoCo's). Both the PyTorch path (``backward(); step()``) and the TF path
(``minimize``) are shown.

Under torchrun (one process per rank; add nodes with ``--nnodes`` and a rendezvous endpoint)::

    torchrun --standalone --nproc-per-node 2 examples/diloco_torchrun.py
    torchrun --standalone --nproc-per-node 2 examples/diloco_torchrun.py \\
             --fragments 4 --wire int8 --delay 1 --alpha 0.5
    torchrun --standalone --nproc-per-node 2 examples/diloco_torchrun.py --algo localsgd
    # on node n, address HOSTn (is_host=true on node 0 only; docs/multinode.md says why)
    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true --local-addr HOSTn \\
        examples/diloco_torchrun.py

Locally without torchrun (spawns 2 gloo ranks on this machine)::

    python examples/diloco_torchrun.py --workers 2
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distoptim
from distoptim.launch import spawn, torchrun_main


def _blobs(n: int = 4096, classes: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification task: each point is drawn around the center of its class."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, 16, generator=g)
    y = torch.randint(classes, (n,), generator=g)
    return centers[y] + 1.2 * torch.randn(n, 16, generator=g), y


def _optimizer(model: nn.Module, algo: str, args: argparse.Namespace) -> distoptim.DiLoCo:
    inner = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.01)
    if algo == "localsgd":
        return distoptim.LocalSGD(inner, sync_every=args.sync_every)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return distoptim.DiLoCo(
        inner,
        outer,
        sync_every=args.sync_every,
        fragments=args.fragments,
        fragment_sync_delay=args.delay,
        fragment_update_alpha=args.alpha,
        wire=args.wire,
    )


def _run(rank: int, world_size: int, algo: str, args: argparse.Namespace) -> float:
    """Train a fresh model with ``algo``; the accuracy of the global copy at the end."""
    torch.manual_seed(0)  # same initial weights on every replica (DiLoCo requires it)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # one GPU per local rank (LOCAL_RANK is set by torchrun)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    opt = _optimizer(model, algo, args)
    x, y = _blobs()
    x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)  # this rank's shard
    batch = args.batch
    accuracy = 0.0
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(100 * epoch + rank))
        for i in range(0, len(x) - batch + 1, batch):
            idx = perm[i : i + batch]
            if i % (2 * batch) == 0:  # PyTorch path
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            else:  # TF path
                opt.minimize(lambda idx=idx: F.cross_entropy(model(x[idx]), y[idx]))
        # the global copy is what every replica agrees on: score it on every rank's shard
        with torch.no_grad():
            local = [p.detach().clone() for p in model.parameters()]
            for p, g in zip(model.parameters(), opt.global_parameters):
                p.copy_(g)
            correct = (model(x).argmax(1) == y).sum().float()
            for p, v in zip(model.parameters(), local):
                p.copy_(v)
        dist.all_reduce(correct)
        accuracy = correct.item() / (len(x) * world_size)
        if rank == 0:
            print(
                f"{algo} epoch {epoch}: global-copy accuracy {accuracy:.3f}  "
                f"({opt.iterations} inner steps, {opt.syncs} fragment syncs, "
                f"{opt.comm_stats.bytes_sent / 1e3:.1f} kB sent by rank 0)"
            )
    # the final sync, on every replica: every model is then the global model
    opt.finish()
    g = torch.cat([t.reshape(-1) for t in opt.global_parameters])
    assert torch.equal(g, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    ref = g.clone()
    dist.broadcast(ref, 0)
    assert torch.equal(g, ref), f"{algo}: replicas' global copies diverged"
    return accuracy


def train(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, float]:
    """Each algorithm of ``--algo`` in turn, on the same ranks and data; accuracy by algorithm."""
    return {algo: _run(rank, world_size, algo, args) for algo in args.algo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="local ranks without torchrun")
    parser.add_argument(
        "--algo",
        nargs="+",
        default=["diloco"],
        choices=["diloco", "localsgd"],
        help="one or both, run in turn (the options below are DiLoCo's)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sync-every", type=int, default=16, help="H: inner steps per sync")
    parser.add_argument("--fragments", type=int, default=1, help="F: Streaming DiLoCo fragments")
    parser.add_argument("--delay", type=int, default=0, help="τ: steps a sync stays in flight")
    parser.add_argument("--alpha", type=float, default=0.0, help="share of local values kept")
    parser.add_argument("--wire", default="fp32", choices=["fp32", "bf16", "int8"])
    args = parser.parse_args()
    diloco_only = {
        "--fragments": args.fragments != 1,
        "--delay": args.delay != 0,
        "--alpha": args.alpha != 0.0,
        "--wire": args.wire != "fp32",
    }
    given = [flag for flag, changed in diloco_only.items() if changed]
    if "diloco" not in args.algo and given:
        parser.error(f"{', '.join(given)}: DiLoCo's options (LocalSGD syncs whole, in fp32)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        torchrun_main(train, args)
    else:
        final = spawn(train, args.workers, args=(args,))[0]
        for algo, accuracy in final.items():
            print(f"{algo}: final accuracy {accuracy:.3f} (the same global copy on all ranks)")


if __name__ == "__main__":
    main()
