"""Data-parallel training with CrossShardOptimizer, runnable under torchrun or locally.

Each rank trains the same MLP on its own shard of a synthetic regression set; the optimizer
averages gradients across ranks (bucketed all-reduce, overlapped with backward) before every
Adam step, so all replicas stay identical. Both the PyTorch path (``backward(); step()``) and
the TF path (``minimize``) are shown; ``finish()`` at the end checks that every rank took the
same steps (see ``docs/cross_shard.md``).

Under torchrun (one process per rank; add nodes with ``--nnodes`` and a rendezvous endpoint)::

    torchrun --nproc-per-node 2 examples/cross_shard_torchrun.py
    # on node n, address HOSTn (is_host=true on node 0 only; docs/multinode.md says why)
    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true --local-addr HOSTn \\
        examples/cross_shard_torchrun.py

Locally without torchrun (spawns 2 gloo ranks on this machine)::

    python examples/cross_shard_torchrun.py --workers 2
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


def _dataset(n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = 0.25 * torch.randn(16, 1, generator=g)
    return x, torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g)


def train(rank: int, world_size: int, epochs: int, batch: int, save: str | None = None) -> float:
    torch.manual_seed(0)  # same initial weights on every rank
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # one GPU per local rank (LOCAL_RANK is set by torchrun)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    opt = distoptim.CrossShardOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), overlap=True)
    x, y = _dataset()
    x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)  # this rank's shard
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(x) - batch + 1, batch):
            idx = perm[i : i + batch]
            if i % (2 * batch) == 0:  # PyTorch path
                opt.zero_grad()
                F.mse_loss(model(x[idx]), y[idx]).backward()
                opt.step()
            else:  # TF path: the loss is scaled by 1/num_shards, gradients summed
                opt.minimize(lambda idx=idx: F.mse_loss(model(x[idx]), y[idx]))
        loss = F.mse_loss(model(x), y).detach()
        dist.all_reduce(loss)
        if rank == 0:
            print(
                f"epoch {epoch}: mean loss over {world_size} ranks {loss.item() / world_size:.4f}"
                f"  ({opt.comm_stats.collectives} collectives, "
                f"{opt.comm_stats.bytes_sent / 1e6:.2f} MB sent by rank 0)"
            )
    # every rank took the same steps (else DesyncError on every rank, not a hang) ...
    opt.finish()
    # ... so every replica holds the same weights
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = w.clone()
    dist.broadcast(ref, 0)
    assert torch.equal(w, ref), "replicas diverged"
    if save and rank == 0:  # the final parameters, to compare runs (e.g. one node vs several)
        torch.save(model.state_dict(), save)
    return loss.item() / world_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="local ranks without torchrun")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--save", default=None, help="rank 0 saves the final parameters here")
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        torchrun_main(train, args.epochs, args.batch, args.save)
    else:
        final = spawn(train, args.workers, args=(args.epochs, args.batch, args.save))
        print(f"final loss {final[0]:.4f} (identical on all {args.workers} ranks)")


if __name__ == "__main__":
    main()
