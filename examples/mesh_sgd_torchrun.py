"""Tensor-parallel training with the mesh-aware SGD on a 1-D DeviceMesh; torchrun or local.

An MLP is split across the ranks of a 1-D mesh with torch's tensor parallelism: the first
Linear column-wise (weight ``Shard(0)``), the second row-wise (weight ``Shard(1)``, bias
``Replicate``). Its parameters are DTensors, and ``distoptim.dtensor.SGD`` keeps its momentum
and EMA slots in the same layouts, updates each rank's local shards with one fused kernel per
layout, and clips by the *global* norm computed over the logical (unsharded) gradients.

Under torchrun (one process per rank; NCCL/CUDA when available, else gloo/CPU)::

    torchrun --standalone --nproc-per-node 2 examples/mesh_sgd_torchrun.py   # one node
    # on node n, address HOSTn (is_host=true on node 0 only; docs/multinode.md says why)
    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true --local-addr HOSTn \\
        examples/mesh_sgd_torchrun.py

Locally without torchrun (spawns gloo ranks on this machine)::

    python examples/mesh_sgd_torchrun.py --workers 2
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from distoptim.dtensor import SGD, EMAOption, GradientsClipOption
from distoptim.launch import spawn, torchrun_main


def _dataset(n: int = 2048, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = 0.5 * torch.randn(16, 1, generator=g)
    return x, torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g)


def train(rank: int, world_size: int, steps: int, batch: int) -> float:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = init_device_mesh(device, (world_size,))
    torch.manual_seed(0)  # every rank builds the same model before it is split
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = SGD(
        model.parameters(),
        learning_rate=0.05,
        momentum=0.9,
        nesterov=True,
        gradients_clip_option=GradientsClipOption(global_clipnorm=1.0),
        ema_option=EMAOption(use_ema=True, ema_momentum=0.99),
        mesh=mesh,  # every parameter must live on this mesh
    )
    x, y = _dataset()
    x, y = x.to(device), y.to(device)
    loss = torch.tensor(0.0)
    for step in range(steps):
        i = (step * batch) % len(x)
        opt.zero_grad()
        loss = F.mse_loss(model(x[i : i + batch]), y[i : i + batch])
        loss.backward()
        opt.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    w = model[0].weight
    assert isinstance(w, DTensor) and opt.get_slot(w, "m").placements == w.placements
    opt.finalize_variable_values(list(model.parameters()))  # weights := their EMA
    with torch.no_grad():
        final = F.mse_loss(model(x), y).item()
    if rank == 0:
        print(f"done: {opt.iterations} steps, full-data loss with EMA weights {final:.4f}")
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="local ranks (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        torchrun_main(train, args.steps, args.batch)
    else:
        losses = spawn(train, args.workers, args=(args.steps, args.batch), timeout=300)
        print(f"final loss per rank: {[round(v, 4) for v in losses]}")


if __name__ == "__main__":
    main()
