"""Replica groups of many processes: DiLoCo / LocalSGD / Streaming DiLoCo across 2 groups x 2.

One 4-rank spawn (gloo, CPU) runs every case without torchft: FSDP2 (``fully_shard`` over the
group's 1-D mesh, ``group=`` the 2-D mesh), tensor parallelism on a 2-D mesh, plain DDP and a
CrossShardOptimizer inside the groups, one sync of every wire format on FSDP2 shards, the
construction errors, and the references (each group one process on the group's concatenated
batch, plain models: ranks 0 and 2, and again ranks 1 and 3). A second 4-rank spawn runs the
torchft cases (a real lighthouse, one manager per process).
The parent checks every rank: every process of every group ends with one model, bitwise, equal
within a derived tolerance to the reference run, and each wire's sync equal to its
single-process reference applied to the shards.

Tolerance against the reference (float32): the runs differ only in how the gradient's mean over
the group's 8 rows is associated (FSDP2 / DDP: the mean of two 4-row means; the reference: one
8-row mean; TP: a matmul split in two). One inner step's gradient thus differs by a few float32
roundings, ``|δg| <= 8·2^-24·|g|`` (``2^-24 ≈ 6e-8``); with ``|g| <= 1``, inner lr 0.1 and
``T = 12`` inner steps plus 3 outer steps of lr 0.7, momentum 0.9 (a gain of at most
``(1 + 0.9 + 0.9²)·0.7 < 2`` per sync), and Lipschitz growth of the tiny MLP below ``2^T``, the
parameters differ by less than ``12 · 0.1 · 5e-7 · 2^12 · 2 ≈ 5e-3`` in the worst case; the
observed difference is ~1e-7, and we assert ``ATOL = 1e-5``: far under the worst case, and over
100 times what the runs show, while one sync's effect (~1e-2) is far above it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distoptim import DiLoCo, LocalSGD
from distoptim.launch import spawn
from tests._support.groups import (
    GROUPS,
    PER_GROUP,
    Attempts,
    group_manager,
    laid_out_per_group,
    raised,
)
from tests._support.groups import full as _full
from tests._support.groups import mesh as _mesh
from tests.comm import reference as wire_ref

pytestmark = pytest.mark.slow  # two 4-rank spawns (about 1-3 min each on 2 loaded cores)

ATOL = 1e-5
ROWS = 8  # a group's batch per inner step (each of its 2 processes takes 4 rows)
STEPS, H = 12, 4
WIRES = ["fp32", "bf16", "int8", "topk:0.25"]
LAYOUTS = ["fsdp", "tp", "ddp", "cross_shard"]
CONFIGS = {  # name: (fragments, fragment_sync_delay, fragment_update_alpha)
    "diloco": (1, 0, 0.0),
    "streaming": (2, 1, 0.5),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5))


def _batch(group: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * group + t)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 5, generator=g)


def _optimizers(net: nn.Module, name: str, cls: str, **kw: Any) -> Any:
    fragments, delay, alpha = CONFIGS[name]
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    if cls == "localsgd":
        return LocalSGD(inner, H, **kw)
    outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return DiLoCo(inner, outer, H, fragments, delay, alpha, **kw)


def _train(model: nn.Module, opt: Any, group: int, rows: slice) -> None:
    for t in range(STEPS):
        x, y = _batch(group, t)
        opt.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    opt.finish()


_MESHES: dict[str, Any] = {}  # per process: each subgroup made once (making one is collective)


def _fsdp(name: str, cls: str, **kw: Any) -> torch.Tensor:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh("shard")
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = _optimizers(model, name, cls, group=mesh, **kw)
    rank = dist.get_rank()
    j = mesh["shard"].get_local_rank()
    _train(model, opt, rank // PER_GROUP, slice(j * ROWS // 2, (j + 1) * ROWS // 2))
    return _full(model)


def _tp(name: str) -> torch.Tensor:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _mesh("tp")
    model = parallelize_module(
        _model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    opt = _optimizers(model, name, "diloco", group=mesh["replicate"])
    _train(model, opt, dist.get_rank() // PER_GROUP, slice(None))  # TP: the whole batch
    return _full(model)


def _ddp(name: str) -> torch.Tensor:
    rank = dist.get_rank()
    if "ddp" not in _MESHES:
        _MESHES["ddp"] = (
            dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])[0],
            dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[0],
        )
    inside, across = _MESHES["ddp"]
    model = nn.parallel.DistributedDataParallel(_model(), process_group=inside)
    opt = _optimizers(model, name, "diloco", group=across, model=model)
    j = rank % PER_GROUP
    _train(model, opt, rank // PER_GROUP, slice(j * ROWS // 2, (j + 1) * ROWS // 2))
    return _full(model.module)


def _cross_shard(name: str) -> torch.Tensor:
    """A CrossShardOptimizer over each group (ranks 0-1, 2-3) as DiLoCo's inner optimizer."""
    from distoptim import CrossShardOptimizer

    rank = dist.get_rank()
    model = _model()
    fragments, delay, alpha = CONFIGS[name]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = CrossShardOptimizer(sgd, group_assignment=[[0, 1], [2, 3]])
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = DiLoCo(inner, outer, H, fragments, delay, alpha, group=[[0, 2], [1, 3]])
    j = rank % PER_GROUP
    _train(model, opt, rank // PER_GROUP, slice(j * ROWS // 2, (j + 1) * ROWS // 2))
    return _full(model)


def _one_sync(wire: str) -> dict[str, torch.Tensor]:
    """One sync of ``wire`` on FSDP2 shards; its Δ and what the global copy became."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh("shard")
    model = _model()
    fully_shard(model, mesh=mesh["shard"])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    opt = DiLoCo(inner, outer, 3, wire=wire, group=mesh)
    before = torch.cat([p.to_local().detach().reshape(-1).clone() for p in model.parameters()])
    local: list[torch.Tensor] = []  # the local values the sync reads: after the 3rd inner step
    inner.register_step_post_hook(
        lambda *_: local.extend(
            p.to_local().detach().reshape(-1).clone() for p in model.parameters()
        )
    )
    j = mesh["shard"].get_local_rank()
    for t in range(3):
        x, y = _batch(dist.get_rank() // PER_GROUP, t)
        opt.zero_grad()
        F.mse_loss(model(x[j * 4 : j * 4 + 4]), y[j * 4 : j * 4 + 4]).backward()
        local.clear()
        opt.step()
    after = torch.cat([g.to_local().reshape(-1) for g in opt.global_parameters])
    delta = before - torch.cat(local)
    return {"before": before, "delta": delta, "after": after.clone(), "bytes": opt.comm_stats}


def _errors() -> dict[str, str]:
    """Configurations that cannot be one model, refused at construction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    attempt = Attempts()
    mesh = _mesh("shard")
    model = _model()
    fully_shard(model, mesh=mesh["shard"])
    attempt("fsdp_over_world", lambda: _optimizers(model, "diloco", "localsgd"))
    unnamed = init_device_mesh("cpu", (GROUPS, PER_GROUP))
    attempt("unnamed_mesh", lambda: _optimizers(model, "diloco", "diloco", group=unnamed))
    mixed = _model()
    fully_shard(mixed[0], mesh=mesh["shard"])
    attempt("mixed", lambda: _optimizers(mixed, "diloco", "diloco", group=mesh))
    attempt("model_type", lambda: _optimizers(model, "diloco", "diloco", group=mesh, model=3))
    attempt(
        "model_without_them",
        lambda: _optimizers(model, "diloco", "diloco", group=mesh, model=_model()),
    )
    return attempt.said


def _mismatched_layouts() -> str:
    """Group 0 shards with FSDP2, group 1 with TP: counterparts hold pieces of other shapes."""
    from torch.distributed.fsdp import fully_shard

    from distoptim.comm.guard import DesyncError

    mesh = _mesh("shard")
    model = laid_out_per_group(_model(), lambda m: fully_shard(m, mesh=mesh["shard"]))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DiLoCo(inner, torch.optim.SGD(model.parameters(), lr=0.7), 1, group=mesh)
    x, y = _batch(0, 0)
    F.mse_loss(model(x), y).backward()
    return raised(opt.step, DesyncError)  # the first sync: its header


def _groups(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name in CONFIGS:
        out["fsdp", name] = _fsdp(name, "diloco")
        out["tp", name] = _tp(name)
        out["ddp", name] = _ddp(name)
        out["cross_shard", name] = _cross_shard(name)
    out["fsdp", "localsgd"] = _fsdp("diloco", "localsgd")
    for wire in WIRES:
        sync = _one_sync(wire)
        sync["bytes"] = sync["bytes"].bytes_sent
        out["wire", wire] = sync
    out["errors"] = _errors()
    out["mismatched_layouts"] = _mismatched_layouts()
    out["reference"] = _reference(rank)
    return out


def _reference(rank: int) -> dict[str, torch.Tensor]:
    """Each group one process on the group's whole batch: ranks 0 and 2 (and again 1 and 3)."""
    if "across" not in _MESHES:
        _MESHES["across"] = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[0]
    out: dict[str, torch.Tensor] = {}
    for name in CONFIGS:
        model = _model()
        opt = _optimizers(model, name, "diloco", group=_MESHES["across"])
        _train(model, opt, rank // PER_GROUP, slice(None))
        out[name] = _full(model)
    model = _model()
    opt = _optimizers(model, "diloco", "localsgd", group=_MESHES["across"])
    _train(model, opt, rank // PER_GROUP, slice(None))
    out["localsgd"] = _full(model)
    return out


@pytest.fixture(scope="module")
def groups() -> list[dict[Any, Any]]:
    return spawn(_groups, GROUPS * PER_GROUP, timeout=300)


@pytest.fixture(scope="module")
def reference(groups) -> list[dict[Any, Any]]:
    return [out["reference"] for out in groups]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_process_of_every_group_ends_with_one_model(groups, layout, name):
    first = groups[0][layout, name]
    for rank in range(GROUPS * PER_GROUP):
        assert torch.equal(groups[rank][layout, name], first), f"rank {rank}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_group_of_two_is_the_one_process_group_on_its_batch(groups, reference, layout, name):
    want = reference[0][name]
    for out in reference:  # the reference itself ends with one model
        assert torch.equal(out[name], want)
    moved = (want - _full(_model())).abs().max()
    assert moved > 100 * ATOL  # training moved the model far beyond the tolerance
    for rank in range(GROUPS * PER_GROUP):
        torch.testing.assert_close(groups[rank][layout, name], want, rtol=0, atol=ATOL)


def test_localsgd_over_fsdp2(groups, reference):
    for rank in range(GROUPS * PER_GROUP):
        assert torch.equal(groups[rank]["fsdp", "localsgd"], groups[0]["fsdp", "localsgd"])
        torch.testing.assert_close(
            groups[rank]["fsdp", "localsgd"], reference[0]["localsgd"], rtol=0, atol=ATOL
        )


@pytest.mark.parametrize("wire", WIRES)
def test_each_wire_on_shards_is_its_reference_on_each_shard(groups, wire):
    """Counterparts (rank j of each group) average their shards: the wire's reference mean of
    their two Δ, then the outer step θ_g - 0.7·mean, bit for bit; the bytes are the shard's."""
    for j in range(PER_GROUP):
        pair = [groups[g * PER_GROUP + j]["wire", wire] for g in range(GROUPS)]
        mean = wire_ref.Mean(wire, GROUPS)([s["delta"] for s in pair])
        want = torch.add(pair[0]["before"], mean, alpha=-0.7)
        for s in pair:
            torch.testing.assert_close(s["after"], want, rtol=0, atol=1e-6)
        assert torch.equal(pair[0]["after"], pair[1]["after"])
    full = sum(p.numel() for p in _model().parameters())
    for rank in range(GROUPS * PER_GROUP):
        sent = groups[rank]["wire", wire]["bytes"]
        shard = groups[rank]["wire", wire]["before"].numel()
        assert shard < full
        if wire == "fp32":  # a ring all-reduce of 2: the shard's 4 bytes per value, once
            assert sent - 4 * shard < 200  # plus the header
        else:
            assert sent < 4 * shard


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("fsdp_over_world", "group= must be the cross-group process group"),
        ("unnamed_mesh", "say which dimension runs across the replica groups"),
        ("mixed", "must be laid out by the same wrapper"),
        ("model_type", "model must be a torch.nn.Module"),
        ("model_without_them", "model must hold the inner optimizer's parameters"),
    ],
)
def test_configurations_that_are_not_one_model_fail_at_construction(groups, case, says):
    for rank in range(GROUPS * PER_GROUP):
        assert says in groups[rank]["errors"][case], (rank, groups[rank]["errors"][case])


# ---- torchft: 2 replica groups of 2 processes, one manager per process -------------------------
def _fsdp_model(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=mesh["shard"])
    return model


def _managed(rank: int, world: int, lighthouse: str) -> dict[str, Any]:
    """Each group's 2 processes have managers of one replica group (their own store); DiLoCo
    against torchft's own DiLoCo on the same FSDP2 model and data; a group whose processes
    differ; a plain model over a 2-process replica group."""
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from distoptim.comm.guard import DesyncError

    group, j = rank // PER_GROUP, rank % PER_GROUP
    # torchft's DiLoCo requires use_async_quorum=False
    manager, _store = group_manager(rank, world, lighthouse, use_async_quorum=False)
    out: dict[str, Any] = {}
    try:
        plain = _model()
        try:
            _optimizers(plain, "diloco", "diloco", manager=manager)
            out["plain"] = "no error"
        except ValueError as exc:
            out["plain"] = str(exc)
        mesh = _mesh("shard")
        rows = slice(j * ROWS // 2, (j + 1) * ROWS // 2)
        ours = _fsdp_model(mesh)
        opt = _optimizers(ours, "diloco", "diloco", manager=manager)
        _train(ours, opt, group, rows)
        out["ours"] = _full(ours)
        theirs = _fsdp_model(mesh)
        inner = torch.optim.SGD(theirs.parameters(), lr=0.1)
        outer = torch.optim.SGD(theirs.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with TorchftDiLoCo(manager, [theirs], inner, outer, sync_every=H):
            for t in range(STEPS):
                x, y = _batch(group, t)
                inner.zero_grad()
                F.mse_loss(theirs(x[rows]), y[rows]).backward()
                inner.step()
        out["torchft"] = _full(theirs)
        # a group whose two processes hold different states: rank 3's copy of its shard is
        # off (the fault), and the next sync's header refuses both groups
        if rank == 3:
            with torch.no_grad():
                opt._global[0].add_(1e-3)
        out["differs"] = raised(lambda: _train(ours, opt, group, rows), DesyncError)
    finally:
        manager.shutdown(wait=False)
    return out


@pytest.fixture(scope="module")
def managed() -> list[dict[str, Any]]:
    from distoptim.ft import Lighthouse

    with Lighthouse(min_replicas=GROUPS) as lighthouse:
        return spawn(_managed, GROUPS * PER_GROUP, args=(lighthouse.address,), timeout=300)


def test_managed_groups_end_with_one_model_equal_to_torchfts_diloco(managed, reference):
    want = managed[0]["torchft"]
    for rank in range(GROUPS * PER_GROUP):
        assert torch.equal(managed[rank]["ours"], managed[0]["ours"]), f"rank {rank}"
        assert torch.equal(managed[rank]["torchft"], want), f"rank {rank}"
        # the same arithmetic in the same order (Δ/2 summed = the sum halved, exactly; the
        # outer step on DTensor gradients around the shard mean): bit for bit
        assert torch.equal(managed[rank]["ours"], want), f"rank {rank}"
        torch.testing.assert_close(managed[rank]["ours"], reference[0]["diloco"], rtol=0, atol=ATOL)


def test_a_plain_model_over_a_two_process_replica_group_fails_at_construction(managed):
    for rank in range(GROUPS * PER_GROUP):
        says = managed[rank]["plain"]
        assert "this torchft replica group has 2 processes" in says, (rank, says)
        assert "would end with 2 different models" in says, (rank, says)


def test_a_group_whose_processes_differ_is_refused_on_every_rank(managed):
    for rank in range(GROUPS * PER_GROUP):
        says = managed[rank]["differs"]
        assert says.startswith("ParameterMismatchError"), (rank, says)
        assert "state checksum" in says, (rank, says)


def test_counterparts_laid_out_differently_fail_the_first_header(groups):
    for rank in range(GROUPS * PER_GROUP):
        says = groups[rank]["mismatched_layouts"]
        assert says.startswith("ParameterMismatchError"), (rank, says)
        assert "group_layout" in says, (rank, says)
