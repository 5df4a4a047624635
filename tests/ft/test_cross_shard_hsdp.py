"""CrossShardOptimizer(manager=) across torchft replica groups of FSDP2 shards: 2 groups x 2.

One 4-rank spawn (gloo, CPU) around a real lighthouse: each group's two processes shard the
model with FSDP2 over the group's 1-D mesh (``mesh["shard"]`` of a ``("replicate", "shard")``
mesh), and each process has its own ``torchft.Manager`` with the group's replica id, its group
rank and ``world_size=2`` (one store per group), as torchtitan + torchft run HSDP: the manager
is the replicate dimension. ``CrossShardOptimizer(opt, manager=m)`` then averages each process's
local shard of the gradient with its counterpart's in the other group. The same spawn runs the
same model, optimizer and data without a manager (``group=mesh``: distoptim's HSDP, bitwise
torch's own by tests/test_cross_shard_groups.py). The parent checks every rank:

(a) every process of every group ends with one model: the gathered parameters are bitwise
    equal on all four ranks, every step committed;
(b) bitwise the run without a manager (SGD with momentum, Adam; ``max_grad_norm`` too, against
    torch's HSDP + ``clip_grad_norm_``). Why bitwise: both compute the same local gradients and
    FSDP2 reduce-scatters them inside the group alike; then the manager's path divides each
    piece by the 2 participants and adds the two, the other adds the two and divides by 2 --
    halving is exact in float32 (no underflow here), so ``a/2 + b/2 = (a + b)/2`` bit for bit
    -- and the inner optimizer runs on identical ``DTensor`` gradients;
(c) each process sends its ``1/k`` piece only: the bucket payload is half the model's bytes;
(d) the state check covers the group's shards: after rank 3 (group 1's second process) moves
    its own shard, the next step is refused with a state-checksum ``DesyncError`` on *every*
    rank -- also on ranks 0 and 2, whose own shards still agree (each group's word combines its
    processes' checksums);
(e) what cannot be one model fails at construction (``group_assignment`` with the manager; a
    model sharded over both groups, whose mesh is not the manager's replica group).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distoptim import CrossShardOptimizer
from distoptim.launch import spawn
from tests._support.groups import GROUPS, PER_GROUP, Attempts, group_manager, raised
from tests._support.groups import full as _full
from tests._support.groups import mesh as _mesh
from tests._support.groups import shard as _shard

pytestmark = pytest.mark.slow  # one 4-rank spawn with torchft managers

ROWS = 8  # a group's batch per step (each of its 2 processes takes 4 rows)
STEPS = 6
CLIP = 0.05  # small enough that clipping changes the run (asserted)
CASES = ["sgd", "adam", "adam_clip"]


def _model() -> nn.Module:
    torch.manual_seed(0)  # 10 rows over 2 processes: uneven shards (5/5) and (2/2) biases
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


def _inner(model: nn.Module, case: str) -> torch.optim.Optimizer:
    if case == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _batch(group: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * group + t)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 4, generator=g)


def _train(model: nn.Module, opt: Any, clip: bool = False, steps: int = STEPS) -> None:
    rank = dist.get_rank()
    group, j = rank // PER_GROUP, rank % PER_GROUP
    rows = slice(j * ROWS // PER_GROUP, (j + 1) * ROWS // PER_GROUP)
    for t in range(steps):
        x, y = _batch(group, t)
        opt.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        if clip:  # torch's HSDP: clip the all-reduced DTensor gradient by its global norm
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
        opt.step()


def _managed_run(case: str, manager: Any) -> dict[str, Any]:
    model = _shard(_model(), _mesh()["shard"])
    clip = CLIP if case.endswith("clip") else None
    opt = CrossShardOptimizer(
        _inner(model, case), name=f"hsdp_{case}", manager=manager, max_grad_norm=clip
    )
    _train(model, opt)
    opt.finish()
    stats = opt.replica_stats
    return {
        "full": _full(model),
        "iterations": opt.iterations,
        "commits": stats.commits,
        "failed": stats.failed,
        "payload": sum(b.payload_bytes for b in opt.bucket_plan.buckets),
        "model": model,
        "opt": opt,
    }


def _unmanaged_run(case: str) -> torch.Tensor:
    model = _shard(_model(), _mesh()["shard"])
    clip = CLIP if case.endswith("clip") else None
    opt = CrossShardOptimizer(_inner(model, case), group=_mesh(), max_grad_norm=clip)
    _train(model, opt)
    opt.finish()
    return _full(model)


def _torch_hsdp_clipped() -> torch.Tensor:
    model = _shard(_model(), _mesh())  # FSDP2 over the 2-D mesh: torch's own HSDP
    _train(model, _inner(model, "adam"), clip=True)
    return _full(model)


def _passes_run(manager: Any) -> dict[str, torch.Tensor]:
    """Two backward passes per step (``backward_passes_per_step=2``), with the manager and with
    ``group=mesh``: the same divisions by powers of two, so bitwise the same model."""
    out = {}
    for how in ("managed", "mesh"):
        model = _shard(_model(), _mesh()["shard"])
        across = {"manager": manager} if how == "managed" else {"group": _mesh()}
        opt = CrossShardOptimizer(_inner(model, "adam"), backward_passes_per_step=2, **across)
        rank = dist.get_rank()
        j = rank % PER_GROUP
        rows = slice(j * ROWS // PER_GROUP, (j + 1) * ROWS // PER_GROUP)
        for t in range(STEPS):
            opt.zero_grad()
            for m in range(2):
                x, y = _batch(rank // PER_GROUP, 100 * (m + 1) + t)
                F.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
        opt.finish()
        out[how] = _full(model)
    return out


def _copies_run(manager: Any) -> dict[str, Any]:
    """Full copies: each group's 2 processes hold the whole model (CrossShard's own round inside
    the group, ``group_assignment``), the manager across; and the same data reduced over all
    four ranks at once without a manager, the reference."""
    out: dict[str, Any] = {}
    for how in ("managed", "world"):
        model = _model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if how == "managed":
            opt = CrossShardOptimizer(
                sgd, name="copies", manager=manager, group_assignment=[[0, 1], [2, 3]]
            )
        else:
            opt = CrossShardOptimizer(sgd, name="copies_world")
        _train(model, opt)
        opt.finish()
        out[how] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if how == "managed":
            stats = opt.replica_stats
            out["commits"], out["payload"] = stats.commits, stats.payload_bytes
            out["whole"] = sum(b.head for b in opt.bucket_plan.buckets) * 4  # float32 bytes
    return out


def _errors(manager: Any) -> dict[str, str]:
    attempt = Attempts()
    model = _shard(_model(), _mesh()["shard"])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    attempt(
        "assignment",
        lambda: CrossShardOptimizer(sgd, manager=manager, group_assignment=[[0, 2], [1, 3]]),
    )
    attempt("overlap", lambda: CrossShardOptimizer(sgd, manager=manager, overlap=True))
    across = _shard(_model(), _mesh())  # sharded over all 4 ranks: not the manager's group
    attempt(
        "across",
        lambda: CrossShardOptimizer(torch.optim.SGD(across.parameters(), lr=0.1), manager=manager),
    )
    return attempt.said


def _drifted(run: dict[str, Any]) -> str:
    """Rank 3 moves its own shard of the first weight; the next step's words refuse it."""
    from distoptim.comm.guard import DesyncError

    model, opt = run["model"], run["opt"]
    if dist.get_rank() == 3:
        with torch.no_grad():
            next(iter(model.parameters())).to_local().add_(1e-3)
    return raised(lambda: _train(model, opt, steps=1), DesyncError)


def _run(rank: int, world: int, lighthouse: str) -> dict[Any, Any]:
    manager, _store = group_manager(rank, world, lighthouse)
    out: dict[Any, Any] = {}
    try:
        out["errors"] = _errors(manager)
        for case in CASES:
            run = _managed_run(case, manager)
            out["managed", case] = {k: v for k, v in run.items() if k not in ("model", "opt")}
            out["plain", case] = _unmanaged_run(case)
        out["torch_clipped"] = _torch_hsdp_clipped()
        out["copies"] = _copies_run(manager)
        out["passes"] = _passes_run(manager)
        out["drifted"] = _drifted(run)
    finally:
        manager.shutdown(wait=False)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[Any, Any]]:
    from distoptim.ft import Lighthouse

    with Lighthouse(min_replicas=GROUPS) as lighthouse:
        return spawn(_run, GROUPS * PER_GROUP, args=(lighthouse.address,), timeout=400)


@pytest.mark.parametrize("case", CASES)
def test_every_process_of_every_group_ends_with_one_model(runs, case):
    first = runs[0]["managed", case]["full"]
    assert not torch.equal(first, _full(_model())), "training changed nothing"
    for rank, out in enumerate(runs):
        got = out["managed", case]
        assert got["iterations"] == STEPS and got["failed"] == 0, (rank, got)
        assert got["commits"] == STEPS + 1, (rank, got)  # every step, and finish()'s round
        assert torch.equal(got["full"], first), f"rank {rank} differs"


@pytest.mark.parametrize("case", CASES)
def test_bitwise_the_same_run_without_a_manager(runs, case):
    for rank, out in enumerate(runs):
        ours, theirs = out["managed", case]["full"], out["plain", case]
        assert torch.equal(ours, theirs), (
            f"rank {rank}: max |diff| {(ours - theirs).abs().max().item():.3g}"
        )


def test_max_grad_norm_is_torchs_hsdp_clip_bitwise(runs):
    for rank, out in enumerate(runs):
        assert torch.equal(out["plain", "adam_clip"], out["torch_clipped"]), rank
        assert not torch.equal(out["plain", "adam_clip"], out["plain", "adam"]), "no clip"


def test_each_process_sends_its_piece_only(runs):
    model_bytes = sum(p.numel() for p in _model().parameters()) * 4
    for rank, out in enumerate(runs):
        assert out["managed", "sgd"]["payload"] * PER_GROUP == model_bytes, rank


def test_the_state_check_covers_every_process_of_the_group(runs):
    for rank, out in enumerate(runs):
        says = out["drifted"]
        assert says.startswith("DesyncError"), (rank, says)
        assert "synchronised state (a bitwise checksum)" in says, (rank, says)


ERRORS = {
    "assignment": "group_assignment= (a channel inside the group) cannot be combined",
    "overlap": "overlap=True does not support yet",
    "across": "this torchft replica group has 2 process(es)",
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_configurations_that_are_not_one_model_fail_at_construction(runs, case):
    for rank, out in enumerate(runs):
        assert ERRORS[case] in out["errors"][case], (rank, out["errors"][case])


def test_full_copies_in_a_group_send_each_their_half_across_and_end_as_one_model(runs):
    """Groups of full copies (not shards): each process averages only its 1/k of every bucket
    with its counterpart, the group all-gathers the halves (sync/group_slices.py). All four
    ranks end bitwise equal, within float32 rounding of one 4-rank reduction (the mean over the
    groups of the groups' means: the same sum in another order; asserted 1e-6, measured ~1e-8),
    and the two processes of a group together put the model's bytes on the wire across groups,
    once per step (with P = 2 a ring all-reduce sends its input's bytes: each its half)."""
    copies = [r["copies"] for r in runs]
    for c in copies[1:]:
        assert torch.equal(c["managed"], copies[0]["managed"])
    for c in copies:
        assert c["commits"] == STEPS + 1  # every step, and finish()
        assert torch.allclose(c["managed"], c["world"], rtol=0, atol=1e-6)
    for g in range(GROUPS):
        pair = copies[g * PER_GROUP : (g + 1) * PER_GROUP]
        assert sum(c["payload"] for c in pair) == STEPS * pair[0]["whole"], pair
        assert all(c["payload"] <= STEPS * (pair[0]["whole"] // 2 + 4) for c in pair), pair


def test_accumulated_passes_under_the_manager_are_the_group_mesh_run_bitwise(runs):
    first = runs[0]["passes"]["managed"]
    assert not torch.equal(first, _full(_model()))
    for rank, out in enumerate(runs):
        assert torch.equal(out["passes"]["managed"], first), rank
        assert torch.equal(out["passes"]["managed"], out["passes"]["mesh"]), rank
