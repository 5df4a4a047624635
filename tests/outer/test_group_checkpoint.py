"""DCP checkpoints of DiLoCo's DTensor state, resharded to another number of processes per group.

One 4-rank spawn (gloo, CPU). For the ``fp32`` and ``int8`` wires: 2 replica groups x 2 processes
with FSDP2 (``Shard(0)``, uneven pieces) train ``SAVE_AT`` steps -- between two syncs, so the
groups' parameters and inner momenta differ, after a sync, so there are outer momenta and int8
residuals -- and ``save_sharded``; then go on uninterrupted. Fresh optimizers load the checkpoint
into (B) the same layout on all four ranks and (C) 2 groups x 1 process, twice over: ranks 0 and 1
with FSDP2 on one-process meshes, ranks 2 and 3 with plain tensors (each pair with its own DCP
process group), and (D) 2 groups x 2 with tensor parallelism (``Shard(0)``, ``Shard(1)`` and
``Replicate`` pieces: another layout of the same size). The parent checks every rank: what each
loaded run exposes (global copy, outer state, each group's parameters, inner state and residuals,
gathered whole) is what was saved, bitwise; and training goes on exactly as the uninterrupted run
(under TP within float32 roundings of its split matmuls).

The runs of different layouts can be compared bitwise because the second process of each 2-process
group contributes a zero gradient (its loss times 0) and the first twice its own (times 2): FSDP2's
mean of the two, ``(2·g + 0) / 2``, is then exactly ``g`` (scaling by a power of two is exact), what
one process computes on the same batch; and the fp32 mean of two groups, the outer SGD and the inner
SGD are elementwise. The int8 wire is not (its scales are per chunk of a bucket of local pieces,
which another layout cuts differently), so after resharding its two one-process variants are
compared with each other; its residuals are compared as saved. Refusals, before anything changes, on
every rank: another wire, other parameter shapes, another number of replica groups, no checkpoint
there, and a checkpoint asked for with a sync in flight. Three fast tests run one process without a
process group (plain tensors, Adam's 0-dim ``step``, two fragments, a nested ``prefix``; the
mesh SGD's own step count two wrappers deep).

Under torchft (the second half): each replica group saves its own checkpoint over its own
processes, and fresh optimizers over the same managers load it at the same k, at another k
(2 -> 1, 1 -> 2) and into 3 groups; see the comment above :func:`_managed_bundle`.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distoptim import CheckpointError, DiLoCo, LocalSGD
from distoptim.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process

H, SAVE_AT, MORE = 2, 3, 4  # a sync every 2 steps; saved after step 3, then 4 more and finish()
ROWS = 8
WIRES = ["fp32", "int8"]


def _model(hidden: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 5))


def _fsdp(mesh: Any, hidden: int = 10) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model(hidden)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tp(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # Shard(0) weight and bias, then Shard(1) weight and a Replicate bias
    return parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _optimizer(model: nn.Module, wire: str, group: Any, **kw: Any) -> DiLoCo:
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return DiLoCo(inner, outer, H, wire=wire, group=group, **kw)


def _steps(model: nn.Module, opt: DiLoCo, group: int, first: int, count: int, w: float) -> None:
    for t in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * group + t)
        x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 5, generator=g)
        opt.zero_grad()
        (w * F.mse_loss(model(x), y)).backward()
        opt.step()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered over its mesh (a collective), a plain tensor as it is."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _record(opt: DiLoCo) -> dict[str, torch.Tensor]:
    """Every tensor of ``sharded_state_dict()``, gathered whole, by its DCP key."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            out[prefix[:-1]] = _whole(value)

    sd = opt.sharded_state_dict()
    sd.pop("distoptim")
    walk("", sd)
    return out


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([_whole(p).reshape(-1) for p in model.parameters()])


def _refused(fn: Any) -> str:
    try:
        fn()
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "not refused"


def _bundle(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "tp"))
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, w = rank // 2, 2.0 if rank % 2 == 0 else 0.0  # (2·g + 0) / 2 = g: see the module
    out: dict[str, Any] = {}
    for wire in WIRES:
        path = os.path.join(root, wire)
        model = _fsdp(mesh["shard"])  # A: 2 groups x 2, uninterrupted
        opt = _optimizer(model, wire, mesh)
        _steps(model, opt, group, 0, SAVE_AT, w)
        out[f"{wire}/saved"] = _record(opt)
        opt.save_sharded(path)
        _steps(model, opt, group, SAVE_AT, MORE, w)
        opt.finish()
        out[f"{wire}/A"] = _full(model)

        model = _fsdp(mesh["shard"])  # B: the same layout, loaded
        opt = _optimizer(model, wire, mesh)
        opt.load_sharded(path)
        out[f"{wire}/B/loaded"], out[f"{wire}/B/step"] = _record(opt), opt.iterations
        _steps(model, opt, group, SAVE_AT, MORE, w)
        opt.finish()
        out[f"{wire}/B"] = _full(model)

        pair = pairs[rank // 2]  # C: 2 groups x 1 (FSDP2 on ranks 0, 1; plain on 2, 3)
        one = DeviceMesh.from_group(singles[rank], "cpu", mesh_dim_names=("shard",))
        model = _fsdp(one) if rank < 2 else _model()
        opt = _optimizer(model, wire, pair)
        opt.load_sharded(path, process_group=pair)
        out[f"{wire}/C/loaded"], out[f"{wire}/C/step"] = _record(opt), opt.iterations
        _steps(model, opt, rank % 2, SAVE_AT, MORE, 1.0)
        opt.finish()
        out[f"{wire}/C"] = _full(model)

        model = _tp(tp_mesh["tp"])  # D: 2 groups x 2 again, tensor-parallel (other pieces)
        opt = _optimizer(model, wire, tp_mesh["replicate"])
        opt.load_sharded(path)
        out[f"{wire}/D/loaded"], out[f"{wire}/D/step"] = _record(opt), opt.iterations
        _steps(model, opt, group, SAVE_AT, MORE, 1.0)  # TP: every process the whole batch
        opt.finish()
        out[f"{wire}/D"] = _full(model)

    fp32 = os.path.join(root, "fp32")
    model = _fsdp(mesh["shard"])
    opt = _optimizer(model, "int8", mesh)
    _steps(model, opt, group, 0, H, w)  # some state, which a refusal must leave as it is
    before = (_record(opt), opt.iterations)
    out["refused/wire"] = _refused(lambda: opt.load_sharded(fp32))
    out["refused/unchanged"] = (before, (_record(opt), opt.iterations))
    other = _fsdp(mesh["shard"], hidden=8)
    out["refused/shapes"] = _refused(lambda: _optimizer(other, "fp32", mesh).load_sharded(fp32))
    plain = _model()  # 4 groups of one process
    out["refused/groups"] = _refused(lambda: _optimizer(plain, "fp32", None).load_sharded(fp32))
    nowhere = os.path.join(root, "nothing")
    out["refused/missing"] = _refused(lambda: opt.load_sharded(nowhere))
    model = _fsdp(mesh["shard"])
    opt = _optimizer(model, "fp32", mesh, fragment_sync_delay=1)
    _steps(model, opt, group, 0, H, w)  # the sync launched after step 2 is in flight
    try:
        opt.sharded_state_dict()
        out["refused/in_flight"] = "not refused"
    except ValueError as exc:
        out["refused/in_flight"] = str(exc)
    opt.finish()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("group_checkpoint"))
    return spawn(_bundle, 4, (root,), timeout=300)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys of ``a`` whose tensors differ in ``b`` (or are missing there)."""
    return [k for k in a if k not in b or not _same(a[k], b[k])]


def _union(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The two-phase residual of every parameter from the cross-group ranks' parts (each zero
    outside what it averaged), by parameter index."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            if k.startswith("shard_residual."):
                i = k.rsplit(".", 1)[1]
                out[i] = torch.where(
                    (v != 0) | torch.signbit(v), v, out.get(i, torch.zeros_like(v))
                )
    return out


def _replica_keys(state: dict[str, torch.Tensor], g: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith(("shard_residual.", "replica."))
            or k.startswith(f"replica.{g}.")}  # fmt: skip


@pytest.mark.slow  # the 4-rank spawn
@pytest.mark.parametrize("wire", WIRES)
def test_a_reload_in_the_same_layout_is_the_uninterrupted_run(runs, wire):
    for rank, run in enumerate(runs):
        saved = run[f"{wire}/saved"]
        assert run[f"{wire}/B/step"] == SAVE_AT
        assert sorted(run[f"{wire}/B/loaded"]) == sorted(saved), rank
        assert _same_state(saved, run[f"{wire}/B/loaded"]) == [], rank
        assert _same(run[f"{wire}/B"], run[f"{wire}/A"]), rank
    initial = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    assert not _same(runs[0][f"{wire}/A"], initial)  # training moved the model


def _check_loaded(runs: list[dict[str, Any]], wire: str, phase: str, groups: list[int]) -> None:
    """Every rank of ``phase`` exposes what its group (``groups[rank]``) saved, bitwise; the
    two-phase residuals of the two groups together are the saved ones, wherever each element
    now lies (one rank of each group gathers its group's part)."""
    saved = {g: runs[2 * g][f"{wire}/saved"] for g in (0, 1)}  # group g: ranks 2g, 2g+1
    assert _same_state(runs[1][f"{wire}/saved"], saved[0]) == []  # a group's processes agree
    assert _same_state(runs[3][f"{wire}/saved"], saved[1]) == []
    for rank, run in enumerate(runs):
        g, loaded = groups[rank], run[f"{wire}/{phase}/loaded"]
        assert run[f"{wire}/{phase}/step"] == SAVE_AT
        assert _same_state(_replica_keys(saved[g], g), loaded) == [], (rank, wire)
    want = _union([saved[0], saved[1]])
    firsts = [groups.index(g) for g in (0, 1)]
    pairs = [firsts] if phase == "D" else [[0, 1], [2, 3]]  # C: two runs of 2 groups x 1
    for ranks in pairs:
        got = _union([runs[r][f"{wire}/{phase}/loaded"] for r in ranks])
        assert sorted(got) == sorted(want)
        assert all(_same(want[i], got[i]) for i in want), ranks
    if wire == "int8":  # the residuals are not all zero: the comparisons above can fail
        assert any(v.abs().sum() > 0 for k, v in saved[0].items() if "residual" in k)
        assert any(v.abs().sum() > 0 for v in want.values())
    # between syncs the groups differ (so each group's entries are its own)
    assert not _same(saved[0]["replica.0.params.0"], saved[1]["replica.1.params.0"])


@pytest.mark.slow  # the 4-rank spawn
@pytest.mark.parametrize("wire", WIRES)
def test_groups_of_one_process_load_the_state_two_processes_saved(runs, wire):
    _check_loaded(runs, wire, "C", [0, 1, 0, 1])  # ranks 0, 1 and again 2, 3


@pytest.mark.slow  # the 4-rank spawn
@pytest.mark.parametrize("wire", WIRES)
def test_tensor_parallel_groups_load_the_state_fsdp2_groups_saved(runs, wire):
    _check_loaded(runs, wire, "D", [0, 0, 1, 1])
    for rank, run in enumerate(runs):  # and train on as one model per group, then one model
        assert _same(run[f"{wire}/D"], runs[0][f"{wire}/D"]), rank
    # TP splits the matmuls (float32 roundings, ~1e-7 over these 4 steps), nothing else differs
    torch.testing.assert_close(runs[0]["fp32/D"], runs[0]["fp32/A"], rtol=0, atol=1e-5)


@pytest.mark.slow  # the 4-rank spawn
def test_fp32_training_goes_on_after_resharding_as_the_uninterrupted_run(runs):
    for rank, run in enumerate(runs):
        assert _same(run["fp32/C"], runs[0]["fp32/A"]), rank


@pytest.mark.slow  # the 4-rank spawn
def test_int8_training_goes_on_alike_in_both_one_process_layouts(runs):
    for rank, run in enumerate(runs):  # FSDP2 on one process (0, 1) and plain tensors (2, 3)
        assert _same(run["int8/C"], runs[0]["int8/C"]), rank
        assert _same(run["int8/A"], runs[0]["int8/A"]), rank


@pytest.mark.slow  # the 4-rank spawn
@pytest.mark.parametrize(
    "case, says",
    [
        ("wire", "CheckpointMismatchError: DiLoCo DCP checkpoint of another configuration "
                 "(differs in ['wire'])"),
        ("shapes", "CheckpointMismatchError: DiLoCo DCP checkpoint: its parameters' global shapes"),
        ("groups", "(differs in ['num_replicas'])"),
        ("missing", "CheckpointError: could not load"),
    ],
)  # fmt: skip
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank(runs, case, says):
    for rank, run in enumerate(runs):
        assert says in run[f"refused/{case}"], (rank, run[f"refused/{case}"])


@pytest.mark.slow  # the 4-rank spawn
def test_a_refusal_changes_nothing(runs):
    for rank, run in enumerate(runs):
        (before, step), (after, step_after) = run["refused/unchanged"]
        assert step == step_after == H
        assert sorted(before) == sorted(after) and _same_state(before, after) == [], rank


@pytest.mark.slow  # the 4-rank spawn
def test_a_sync_in_flight_is_refused(runs):
    for run in runs:
        assert "is in flight, which a DCP checkpoint does not hold" in run["refused/in_flight"]


# ---- one process, no process group (the format's plain-tensor side; fast) ------------------------
def _lone(fragments: int = 2, cls: str = "diloco") -> tuple[nn.Module, DiLoCo]:
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    if cls == "localsgd":
        return model, LocalSGD(inner, H)
    outer = torch.optim.Adam(model.parameters(), lr=0.1)  # a 0-dim "step" and two moments
    return model, DiLoCo(inner, outer, H, fragments)


def _lone_steps(model: nn.Module, opt: DiLoCo, first: int, count: int) -> None:
    _steps(model, opt, 0, first, count, 1.0)


@pytest.mark.parametrize("cls", ["diloco", "localsgd"])
def test_one_process_nested_under_a_prefix_reloads_bit_for_bit(tmp_path, cls):
    import torch.distributed.checkpoint as dcp

    model, opt = _lone(cls=cls)
    _lone_steps(model, opt, 0, SAVE_AT)
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    _lone_steps(model, opt, SAVE_AT, MORE)
    opt.finish()
    again, fresh = _lone(cls=cls)
    fresh.load_sharded(str(tmp_path), prefix="optim")
    assert fresh.iterations == SAVE_AT
    _lone_steps(again, fresh, SAVE_AT, MORE)
    fresh.finish()
    assert _same(_full(again), _full(model))
    assert fresh.state_dict()["wrapper"]["syncs"] == opt.state_dict()["wrapper"]["syncs"]


def test_one_process_refusals_change_nothing(tmp_path):
    model, opt = _lone()
    _lone_steps(model, opt, 0, SAVE_AT)
    opt.save_sharded(str(tmp_path / "ckpt"))
    other_model, other = _lone(fragments=1)
    _lone_steps(other_model, other, 0, 1)
    before = (_record(other), other.iterations, _full(other_model))
    with pytest.raises(ValueError, match=r"differs in \['fragments'\]"):
        other.load_sharded(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="not a DiLoCo DCP checkpoint under 'optim'"):
        other.load_sharded(str(tmp_path / "ckpt"), prefix="optim")
    with pytest.raises(CheckpointError, match="does not exist"):
        other.load_sharded(str(tmp_path / "none"))
    after = (_record(other), other.iterations, _full(other_model))
    assert _same_state(before[0], after[0]) == [] and before[1] == after[1]
    assert _same(before[2], after[2])


def _over_a_wrapper() -> tuple[nn.Module, DiLoCo]:
    """DiLoCo over a WrappedOptimizer over the mesh SGD with a decaying rate; the SGD and the
    WrappedOptimizer each step once alone before they are wrapped (three different counts)."""
    from distoptim import WrappedOptimizer
    from distoptim.dtensor import SGD as MeshSGD
    from distoptim.dtensor import ExponentialDecay

    model = _model()
    sgd = MeshSGD(model.parameters(), learning_rate=ExponentialDecay(0.1, 2, 0.5), momentum=0.9)
    inner = WrappedOptimizer(sgd)
    for opt in (sgd, inner):
        _steps(model, opt, 0, 100, 1, 1.0)  # (another batch than the run's)
    return model, DiLoCo(inner, torch.optim.SGD(model.parameters(), lr=0.7), H)


def test_one_process_keeps_the_step_count_of_a_mesh_sgd_two_wrappers_deep(tmp_path):
    """The mesh SGD's own count (its schedule reads it) comes back from the DCP checkpoint of
    DiLoCo over a WrappedOptimizer, and the resumed run continues bit for bit."""
    model, opt = _over_a_wrapper()
    _lone_steps(model, opt, 0, SAVE_AT)
    opt.save_sharded(str(tmp_path))
    _lone_steps(model, opt, SAVE_AT, MORE)
    opt.finish()
    again, fresh = _over_a_wrapper()
    fresh.load_sharded(str(tmp_path))
    counts = (fresh.iterations, fresh.wrapped.iterations, fresh.wrapped.wrapped.iterations)
    assert counts == (SAVE_AT, SAVE_AT + 1, SAVE_AT + 2)
    _lone_steps(again, fresh, SAVE_AT, MORE)
    fresh.finish()
    assert _same(_full(again), _full(model))


# ---- torchft: each replica group saves its own DCP checkpoint, loads it at another k ----------
# One spawn per configuration, each around a real lighthouse with one manager per process (the
# group's processes share a store hosted by its rank 0): 2 groups x 2 (FSDP2 over the group's
# mesh), 2 groups x 1 (FSDP2 over one process), 3 groups x 1. Every run trains SAVE_AT steps
# (saved there: between two syncs, after one), then MORE, then finish(); a run that loads a
# checkpoint trains on from SAVE_AT. The order of the spawns: k=2 saves; k=1 saves and loads
# k=2's; k=2 loads k=1's; 3 groups load k=1's (the third group a copy of group 0's).
MANAGED_WIRES = ["fp32", "int8"]


def _managed_bundle(
    rank: int, world: int, lighthouse: str, root: str, groups: int, load_from: str, whole: bool
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from distoptim.ft import make_manager

    k = world // groups
    group, j = rank // k, rank % k
    store = (
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if j == 0 else None
    )
    ports: list[Any] = [None] * world
    dist.all_gather_object(ports, store.port if store is not None else None)
    manager = make_manager(
        lighthouse, replica_id=f"group{group}", state_dict=lambda: {},
        load_state_dict=lambda _: None, min_replica_size=groups, rank=j, world_size=k,
        store_addr="127.0.0.1", store_port=ports[group * k], use_async_quorum=False,
        init_sync=False, timeout=60.0, quorum_timeout=120.0,
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (groups, k), mesh_dim_names=("replicate", "shard"))
    pg = mesh["shard"].get_group()  # the group's own processes: its DCP collectives
    w = 1.0 if k == 1 else (2.0 if j == 0 else 0.0)  # (2·g + 0) / 2 = g: see the module
    out: dict[str, Any] = {}

    def build(wire: str, name: str) -> tuple[nn.Module, DiLoCo]:
        model = _fsdp(mesh["shard"])
        return model, _optimizer(model, wire, None, manager=manager, name=name)

    try:
        for wire in MANAGED_WIRES if groups == 2 else ["int8"]:
            if whole:  # uninterrupted, saving this group's checkpoint at SAVE_AT
                model, opt = build(wire, f"A-{wire}")
                _steps(model, opt, group, 0, SAVE_AT, w)
                out[f"{wire}/saved"] = _record(opt)
                opt.save_sharded(
                    os.path.join(root, f"k{k}", wire, f"group{group}"), process_group=pg
                )
                _steps(model, opt, group, SAVE_AT, MORE, w)
                opt.finish()
                out[f"{wire}/A"] = _full(model)
            source = group if group < 2 else 0  # a third group: a copy of group 0's
            model, opt = build(wire, f"B-{wire}")
            opt.load_sharded(
                os.path.join(root, load_from, wire, f"group{source}"), process_group=pg
            )
            out[f"{wire}/B/loaded"], out[f"{wire}/B/step"] = _record(opt), opt.iterations
            out[f"{wire}/B/residuals"] = [
                float(v.abs().sum())
                for e in opt._exchanges
                for r in e.residuals
                for v in r.values()
            ]
            _steps(model, opt, group, SAVE_AT, MORE, w)
            opt.finish()
            out[f"{wire}/B"] = _full(model)
            out[f"{wire}/B/layout"] = opt.state_dict()["wrapper"]["layout"]
        if whole and k == 2:  # refusals, before anything changes
            path = os.path.join(root, "k2", "int8", f"group{group}")
            model, opt = build("fp32", "refused")
            before = (_record(opt), opt.iterations)
            out["refused/wire"] = _refused(lambda: opt.load_sharded(path, process_group=pg))
            out["refused/unchanged"] = (before, (_record(opt), opt.iterations))
            plain = _optimizer(_fsdp(mesh["shard"]), "int8", mesh)  # no manager: 2 groups
            out["refused/unmanaged"] = _refused(lambda: plain.load_sharded(path, process_group=pg))
    finally:
        manager.shutdown(wait=False)
    return out


_MANAGED_RUNS = [  # name, groups, processes, the checkpoint it loads, whether it runs uninterrupted
    ("k2", 2, 4, "k2", True),  # saves k=2 (A), reloads it in the same layout (B)
    ("k1", 2, 2, "k2", True),  # saves k=1 (A), loads k=2's (B)
    ("k2_from_k1", 2, 4, "k1", False),  # loads k=1's
    ("n3", 3, 3, "k1", False),  # 3 groups load the checkpoints of 2 (the third group 0's)
]


@pytest.fixture(scope="module")
def managed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    from distoptim.ft import Lighthouse

    pytest.importorskip("torchft")
    root = str(tmp_path_factory.mktemp("managed_checkpoint"))
    out: dict[str, list[dict[str, Any]]] = {}
    for name, groups, world, load_from, whole in _MANAGED_RUNS:
        with Lighthouse(min_replicas=groups) as lighthouse:
            args = (lighthouse.address, root, groups, load_from, whole)
            out[name] = spawn(_managed_bundle, world, args, timeout=300)
    return out


# int8 across group sizes: its scales are per chunk of a bucket of local pieces, so another k
# rounds other elements together. Per sync and element, the two layouts' roundings differ by at
# most 2 encodings (Δ, then the mean) x 2 layouts x max|Δ|/254; max|Δ| here is ~0.03, so ~5e-4
# per sync. Four syncs (steps 2, 4, 6 and finish) through Nesterov's outer step (gain 0.7·1.9 <
# 1.4 at once, momentum 0.9 carrying it on) and the inner steps after each: a few 1e-3 at worst.
# Observed ~4e-4; asserted 5e-3, while training moves the model by over 40 times that (~0.23).
ATOL_INT8 = 5e-3


def _shard_residuals_kept(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> bool:
    """Every element of every loaded two-phase residual is its saved value, bitwise, or +0.0 (an
    element this process's new shard holds that the group's old one did not)."""
    for key, s in saved.items():
        if key.startswith("shard_residual."):
            got = loaded[key]
            zero = (got == 0) & ~torch.signbit(got)
            if not bool((_bits(got) == _bits(s)).logical_or(zero).all()):
                return False
    return True


def _check_managed_load(
    managed_runs: dict[str, list[dict[str, Any]]], name: str, source: str, wire: str
) -> None:
    """Every process of ``name`` exposes what its group saved in ``source``, bitwise (the
    two-phase residual as :func:`_shard_residuals_kept` says, wholly when the layout is the
    same), at the saved step."""
    saved_by = managed_runs[source]
    k_saved = len(saved_by) // 2
    runs = managed_runs[name]
    k = len(runs) // (3 if name == "n3" else 2)
    for rank, run in enumerate(runs):
        group = rank // k if rank // k < 2 else 0  # a third group loaded group 0's
        saved = saved_by[group * k_saved][f"{wire}/saved"]
        loaded = run[f"{wire}/B/loaded"]
        assert run[f"{wire}/B/step"] == SAVE_AT, rank
        assert sorted(loaded) == sorted(saved), rank
        exact = [key for key in saved if not key.startswith("shard_residual.")]
        assert _same_state({key: saved[key] for key in exact}, loaded) == [], (rank, name)
        if k == k_saved:
            assert _same_state(saved, loaded) == [], (rank, name)
        assert _shard_residuals_kept(saved, loaded), (rank, name)


@pytest.mark.slow  # four spawns (4, 2, 4, 3 processes) around real lighthouses
def test_managed_checkpoints_hold_one_groups_state_whatever_its_quorum_rank(managed_runs):
    runs = managed_runs["k2"]
    for wire in MANAGED_WIRES:
        keys = [sorted(run[f"{wire}/saved"]) for run in runs]
        assert all(k == keys[0] for k in keys)  # the same entries in both groups: replica.0.*
        assert all(not k.startswith("replica.1.") for k in keys[0])
        # between syncs the groups differ, so each group's checkpoint is its own
        assert not _same(runs[0][f"{wire}/saved"]["replica.0.params.0"],
                         runs[2][f"{wire}/saved"]["replica.0.params.0"])  # fmt: skip
        assert _same_state(runs[0][f"{wire}/saved"], runs[1][f"{wire}/saved"]) == []
    int8 = runs[0]["int8/saved"]  # lossy: there are residuals, or the checks could not fail
    assert any(v.abs().sum() > 0 for k, v in int8.items() if k.startswith("replica.0.residual"))
    assert any(v.abs().sum() > 0 for k, v in int8.items() if k.startswith("shard_residual"))


@pytest.mark.slow
@pytest.mark.parametrize("wire", MANAGED_WIRES)
def test_managed_reload_in_the_same_layout_is_the_uninterrupted_run(managed_runs, wire):
    _check_managed_load(managed_runs, "k2", "k2", wire)
    for rank, run in enumerate(managed_runs["k2"]):
        assert _same(run[f"{wire}/B"], run[f"{wire}/A"]), rank
        assert run[f"{wire}/B/layout"] == [[2, rank // 2]]  # the quorum kept the residuals


@pytest.mark.slow
@pytest.mark.parametrize("wire", MANAGED_WIRES)
@pytest.mark.parametrize(("name", "source"), [("k1", "k2"), ("k2_from_k1", "k1")])
def test_managed_groups_load_the_state_groups_of_another_size_saved(
    managed_runs, wire, name, source
):
    _check_managed_load(managed_runs, name, source, wire)
    runs = managed_runs[name]
    want = managed_runs[source][0][f"{wire}/A"]  # the run the checkpoint was taken from
    for rank, run in enumerate(runs):
        assert _same(run[f"{wire}/B"], runs[0][f"{wire}/B"]), rank  # one model everywhere
        if wire == "fp32":  # every step is elementwise or exact across k: bit for bit
            assert _same(run[f"{wire}/B"], want), rank
        else:
            torch.testing.assert_close(run[f"{wire}/B"], want, rtol=0, atol=ATOL_INT8)
    initial = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    assert (want - initial).abs().max() > 40 * ATOL_INT8  # training moved the model (by ~0.23)


@pytest.mark.slow
def test_a_checkpoint_of_two_groups_loads_into_three_residuals_restart(managed_runs):
    """Each group loads a group's checkpoint (the third a copy of group 0's); the first sync's
    quorum has 3 members, so every group's exchange is rebuilt for it and its residuals start
    from zero, as in a running job that a third group joins."""
    _check_managed_load(managed_runs, "n3", "k1", "int8")
    runs = managed_runs["n3"]
    for rank, run in enumerate(runs):
        assert any(r > 0 for r in run["int8/B/residuals"]), rank  # held until that quorum
        assert run["int8/B/layout"] == [[3, rank]], rank
        assert _same(run["int8/B"], runs[0]["int8/B"]), rank  # one global model
    assert not _same(runs[0]["int8/B"], managed_runs["k1"][0]["int8/A"])  # three groups' mean


@pytest.mark.slow
def test_managed_refusals_name_what_differs_and_change_nothing(managed_runs):
    for rank, run in enumerate(managed_runs["k2"]):
        assert "(differs in ['wire'])" in run["refused/wire"], rank
        assert "a torchft-managed optimizer's checkpoint" in run["refused/unmanaged"], rank
        (before, step), (after, step_after) = run["refused/unchanged"]
        assert step == step_after == 0
        assert sorted(before) == sorted(after) and _same_state(before, after) == [], rank


@pytest.mark.parametrize(
    "quorum, says",
    [
        (None, "not one of a torchft-managed optimizer"),
        ([[2, 0], [2, 1]], "not one of a torchft-managed optimizer"),  # 2 fragments, not 1
        ([[2, 2]], "0 <= rank < size, got [2, 2]"),
        ([[2, True]], "0 <= rank < size, got [2, True]"),
    ],
)
def test_a_managed_checkpoints_quorum_layout_is_checked(quorum, says):
    from distoptim.outer.checkpoint import check_quorum_layout

    assert check_quorum_layout("DiLoCo", [[3, 2]], 1) == [(3, 2)]
    with pytest.raises(ValueError) as exc:
        check_quorum_layout("DiLoCo", quorum, 1)
    assert says in str(exc.value)
