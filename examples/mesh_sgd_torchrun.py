"""Tensor- and data-parallel training with the mesh-aware SGD on a DeviceMesh; torchrun or local.

An MLP's parameters are DTensors on a 1-D or 2-D mesh. The last mesh dimension (``tp``) is
tensor parallel: the first Linear is split column-wise (weight and bias ``Shard(0)``), the
second row-wise (weight ``Shard(1)``, bias ``Replicate``). A 2-D mesh (``--mesh DPxTP``) adds a
data-parallel dimension in front (``dp``): every ``dp`` coordinate trains on its own slice of
each batch, so every gradient is ``Partial`` over ``dp`` and is summed across it when the
optimizer brings it to its parameter's placements; the first weight is also sharded over
``dp`` (its input features, ZeRO-style: all-gathered for the forward pass, its gradient
reduce-scattered). The placements, per mesh dimension ``(dp, tp)``::

    0.weight (64, 16)   (Shard(1), Shard(0))     0.bias (64)   (Replicate(), Shard(0))
    2.weight (1, 64)    (Replicate(), Shard(1))  2.bias (1)    (Replicate(), Replicate())

(without ``dp``, only the last entry of each). Ranks fill the mesh row by row: with
``--nproc-per-node TP`` the ``tp`` groups are the processes of one node and the ``dp`` groups
span the nodes, so the gradient sums and the all-gather run across the nodes.
``distoptim.dtensor.SGD`` keeps its momentum and EMA slots in the same layouts, updates each
rank's local shards with one fused kernel per layout, and clips by the *global* norm computed
over the logical (unsharded) gradients. The loss is the mean over the whole batch whatever the
mesh, so every mesh shape trains the same model up to float rounding.

Under torchrun (one process per rank; NCCL/CUDA when available, else gloo/CPU)::

    torchrun --standalone --nproc-per-node 2 examples/mesh_sgd_torchrun.py   # one node
    torchrun --standalone --nproc-per-node 4 examples/mesh_sgd_torchrun.py --mesh 2x2
    # two nodes, a 2x2 mesh: tp within a node, dp across them. On node n, address HOSTn
    # (is_host=true on node 0 only; docs/multinode.md says why)
    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true --local-addr HOSTn \\
        examples/mesh_sgd_torchrun.py --mesh 2x2

Locally without torchrun (spawns gloo ranks on this machine)::

    python examples/mesh_sgd_torchrun.py --workers 2
    python examples/mesh_sgd_torchrun.py --workers 4 --mesh 2x2

``--save final.pt``: rank 0 writes the trained (full, unsharded) parameters.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from distoptim.dtensor import SGD, EMAOption, GradientsClipOption
from distoptim.launch import spawn, torchrun_main

# parameter -> (placement over dp, placement over tp); a 1-D mesh (tp only) uses the second
_PLACEMENTS: dict[str, tuple[Placement, Placement]] = {
    "0.weight": (Shard(1), Shard(0)),
    "0.bias": (Replicate(), Shard(0)),
    "2.weight": (Replicate(), Shard(1)),
    "2.bias": (Replicate(), Replicate()),
}


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"4"`` -> ``(4,)``, ``"2x2"`` -> ``(2, 2)`` (dp x tp); sizes >= 1, one or two of them."""
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (1, 2) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--mesh must be TP or DPxTP (e.g. 4, 2x2), got {text!r}")
    return shape


def _dataset(n: int = 2048, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = 0.5 * torch.randn(16, 1, generator=g)
    return x, torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g)


def _build(mesh: DeviceMesh) -> nn.Module:
    """The MLP, the same on every rank, its parameters distributed on ``mesh``."""
    torch.manual_seed(0)  # every rank builds the same model before it is split
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(mesh.device_type)

    def partition(prefix: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, p in list(module.named_parameters(recurse=False)):
            placements = _PLACEMENTS[f"{prefix}.{name}"][-mesh.ndim :]
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
            )

    return distribute_module(model, mesh, partition)


def _batch(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``t`` (the whole batch, the same on every rank) as a DTensor: split over ``dp``, each
    ``dp`` coordinate keeping its rows, replicated over ``tp``."""
    if mesh.ndim == 1:
        return DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
    dp = mesh.size(0)
    rows = t.shape[0] // dp
    mine = t[mesh.get_local_rank(0) * rows : (mesh.get_local_rank(0) + 1) * rows]
    return DTensor.from_local(mine, mesh, (Shard(0), Replicate()), run_check=False)


def train(
    rank: int, world_size: int, steps: int, batch: int, shape: tuple[int, ...] | None, save: str
) -> float:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    shape = shape or (world_size,)
    if torch.Size(shape).numel() != world_size:
        raise ValueError(
            f"--mesh {'x'.join(map(str, shape))} has {torch.Size(shape).numel()} places, "
            f"the job has {world_size} ranks"
        )
    if batch % shape[0]:
        raise ValueError(f"--batch {batch} must be a multiple of the dp size {shape[0]}")
    names = ("dp", "tp")[-len(shape) :]
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    model = _build(mesh)
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
    for step in range(steps):
        i = (step * batch) % len(x)
        opt.zero_grad()
        loss = F.mse_loss(model(_batch(x[i : i + batch], mesh)), _batch(y[i : i + batch], mesh))
        loss.backward()
        opt.step()
        if step % 50 == 0:
            value = loss.full_tensor().item()  # a collective: every rank takes part
            if rank == 0:
                print(f"step {step:4d}  loss {value:.4f}", flush=True)
    w = model[0].weight
    assert isinstance(w, DTensor) and opt.get_slot(w, "m").placements == w.placements
    opt.finalize_variable_values(list(model.parameters()))  # weights := their EMA
    with torch.no_grad():
        final = F.mse_loss(model(_batch(x, mesh)), _batch(y, mesh)).full_tensor().item()
    full = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}
    if rank == 0:
        mesh_text = "x".join(map(str, shape))
        print(f"done: {opt.iterations} steps on mesh {mesh_text} {names}, full-data loss with "
              f"EMA weights {final:.4f}")  # fmt: skip
        if save:
            torch.save(full, save)
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="local ranks (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--mesh", type=parse_mesh, default=None,
                    help="TP or DPxTP, e.g. 2x2 (default: 1-D over every rank)")  # fmt: skip
    ap.add_argument("--save", default="", help="rank 0 saves the full parameters here")
    args = ap.parse_args()
    run_args = (args.steps, args.batch, args.mesh, args.save)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        torchrun_main(train, *run_args)
    else:
        losses = spawn(train, args.workers, args=run_args, timeout=300)
        print(f"final loss per rank: {[round(v, 4) for v in losses]}")


if __name__ == "__main__":
    main()
