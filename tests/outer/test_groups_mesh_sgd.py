"""The Keras mesh SGD (``distoptim.dtensor.SGD``) as DiLoCo's inner over FSDP2, 2 groups x 2.

One 4-rank spawn (gloo, CPU): every group's model is ``fully_shard``-ed over its row of a 2-D
``DeviceMesh`` ``(replicate, shard)``, ``DiLoCo(inner, outer, H, group=mesh)`` averages the
groups every ``H`` inner steps, and the inner optimizer is the mesh SGD with Keras' rule
(``v = μ·v - lr·g; w += v``, Nesterov ``w += μ·v - lr·g``). Each case runs the same training
(same initial model, same data, same Nesterov outer SGD) twice, with the mesh SGD and with an
equivalent inner optimizer, and the parent checks every rank:

* every process of every group ends with one model, bitwise (gathered full parameters);
* momentum 0 (``w ← w - lr·g``): equal **bitwise** to ``torch.optim.SGD(lr)`` (both compute
  one ``w + (-lr)·g`` per element, in the same order, on the same local shards);
* momentum 0.9, plain and Nesterov, constant ``lr``: Keras' ``v`` is ``-lr·b`` for torch's
  buffer ``b = μ·b + g`` (``v₀ = b₀ = 0``, and ``-lr·(μ·b + g) = μ·(-lr·b) - lr·g``), so Keras'
  rule is ``torch.optim.SGD(lr, momentum, nesterov)``'s in exact arithmetic; only the
  rounding differs (the mesh SGD runs torch's fused kernel on the local shards, torch's SGD
  foreach ops through DTensor dispatch, bitwise equal to the fused one on plain tensors but for
  a few last-bit roundings of ``b`` and ``w``): compared within ``ATOL``, below;
* a decaying learning rate (``ExponentialDecay``): torch's SGD is no longer equivalent (its
  buffer does not carry the rate), so the reference is Keras' rule written out on the
  parameters (``_KerasRule``, DTensor ops): within ``ATOL``;
* the momentum slot follows each parameter's layout: the internal buffer, ``get_slot(p, "m")``
  and the saved ``"m"`` are ``DTensor``s on the parameter's mesh and placements holding only the
  local shard (``1/k`` of the elements and of the storage, ``k = 2``);
* ``state_dict()`` / ``load_state_dict()`` of that DiLoCo round-trips: a run saved between two
  syncs and resumed in a fresh model and fresh optimizers continues bit for bit like the
  uninterrupted run (with the decaying rate: the inner's own step count, which the schedule
  reads, is restored too), and so does the DCP checkpoint (``save_sharded``/``load_sharded``).

A second 4-rank spawn runs the ``plain`` and ``decay`` cases with torchft managers (a real
lighthouse, one manager per process and optimizer) as the cross-group channel: one model on
every rank, the same comparisons, and the very model the ``group=mesh`` run ends with.

Tolerance (float32): the compared runs take the same gradients' path but round differently:
each inner step's update of a parameter differs by a few roundings, ``|δw| <= 4·2^-24·(|w| +
|v| + lr·|g|)`` with ``|w|, |g| <= 1`` and ``|v| <= lr·|g|/(1 - μ) <= 1`` (lr 0.1, μ 0.9), about
``7e-7`` per step. Carried by the momentum (a gain of at most ``1/(1 - μ) = 10``) over
``T = 12`` inner steps and 3 outer steps (a gain below 2 each) it stays under ``12 · 7e-7 · 10
· 2 ≈ 2e-4`` before the tiny MLP's Lipschitz growth (the worst case, far from what happens).
Measured: at most 6e-8 (momentum), 3e-8 (Nesterov), 9e-8 (decay), while training moves the
model by 0.5 to 0.7; we assert ``ATOL = 1e-5``: over 100 times what the runs show, and training
must move the model by more than 100 times it (asserted).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distoptim import DiLoCo
from distoptim.dtensor import SGD as MeshSGD
from distoptim.dtensor import ExponentialDecay
from distoptim.launch import spawn
from tests._support.groups import group_manager

pytestmark = pytest.mark.slow  # two 4-rank spawns (about 1 min each on 2 loaded cores)

ATOL = 1e-5
GROUPS, PER_GROUP = 2, 2
ROWS = 8  # a group's batch per inner step (each of its 2 processes takes 4 rows)
STEPS, H = 12, 4
SAVE_AT = 6  # between the syncs at steps 4 and 8
LR = 0.1
DECAY = ExponentialDecay(initial_learning_rate=LR, decay_steps=4, decay_rate=0.5)
CASES = {  # name: (learning rate, momentum, nesterov)
    "plain": (LR, 0.0, False),
    "momentum": (LR, 0.9, False),
    "nesterov": (LR, 0.9, True),
    "decay": (DECAY, 0.9, True),
}


def _model() -> nn.Module:
    """Every dimension 0 even, so FSDP2's ``Shard(0)`` gives each process exactly half."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


def _batch(group: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * group + t)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 4, generator=g)


class _KerasRule(torch.optim.Optimizer):
    """Keras' SGD written out on the parameters (DTensor ops): ``v = μ·v - lr·g``, then
    ``w += v`` (Nesterov: ``w += μ·v - lr·g``), ``lr`` the schedule at the step count."""

    def __init__(self, params: Any, schedule: Any, momentum: float, nesterov: bool) -> None:
        super().__init__(params, {"lr": schedule(0)})
        self.schedule, self.momentum, self.nesterov, self.t = schedule, momentum, nesterov, 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        lr, mu = self.schedule(self.t), self.momentum
        for p in (p for g in self.param_groups for p in g["params"] if p.grad is not None):
            v = self.state[p].setdefault("v", torch.zeros_like(p))
            v.mul_(mu).add_(p.grad, alpha=-lr)
            p.add_(v * mu - lr * p.grad if self.nesterov else v)
        self.t += 1


def _inner(model: nn.Module, case: str, kind: str) -> torch.optim.Optimizer:
    lr, momentum, nesterov = CASES[case]
    if kind == "mesh":
        return MeshSGD(model.parameters(), learning_rate=lr, momentum=momentum, nesterov=nesterov)
    if callable(lr):
        return _KerasRule(model.parameters(), lr, momentum, nesterov)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=nesterov)


_MESH: list[Any] = []  # per process: made once (making one is collective)


def _build(case: str, kind: str) -> tuple[nn.Module, DiLoCo]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not _MESH:
        _MESH.append(
            init_device_mesh("cpu", (GROUPS, PER_GROUP), mesh_dim_names=("replicate", "shard"))
        )
    mesh = _MESH[0]
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    inner = _inner(model, case, kind)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return model, DiLoCo(inner, outer, H, group=mesh)


def _train(model: nn.Module, opt: DiLoCo, first: int, last: int) -> None:
    rank = dist.get_rank()
    j = _MESH[0]["shard"].get_local_rank()
    for t in range(first, last):
        x, y = _batch(rank // PER_GROUP, t)
        rows = slice(j * ROWS // PER_GROUP, (j + 1) * ROWS // PER_GROUP)
        opt.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()


def _full(model: nn.Module) -> torch.Tensor:
    """Every parameter gathered whole (a collective over the group), flattened."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _layout(p: torch.Tensor, slot: Any) -> dict[str, Any]:
    """How the slot ``slot`` of parameter ``p`` is laid out, against ``p``'s layout."""
    from torch.distributed.tensor import DTensor

    if not isinstance(slot, DTensor):
        return {"dtensor": False}
    local = slot.to_local()
    return {
        "dtensor": True,
        "same_mesh": slot.device_mesh == p.device_mesh,
        "same_placements": tuple(slot.placements) == tuple(p.placements),
        "global_shape": tuple(slot.shape) == tuple(p.shape),
        "local_shape": tuple(local.shape) == tuple(p.to_local().shape),
        "local_numel": local.numel(),
        "storage_bytes": local.untyped_storage().nbytes(),
        "full_numel": p.numel(),
        "itemsize": local.element_size(),
    }


def _slots(model: nn.Module, inner: MeshSGD) -> list[dict[str, Any]]:
    """Per parameter: the internal momentum buffer, ``get_slot(p, "m")`` and the saved
    ``"m"``, each described by :func:`_layout`."""
    saved = inner.state_dict()["state"]
    out = []
    for i, p in enumerate(model.parameters()):
        internal = [v for v in inner.state[p].values() if isinstance(v, torch.Tensor)]
        out.append(
            {
                "internal": [_layout(p, v) for v in internal if v.dim() > 0],
                "get_slot": _layout(p, inner.get_slot(p, "m")),
                "saved": _layout(p, saved.get(i, {}).get("m")),
                "names": inner.get_slot_names(),
            }
        )
    return out


def _resumed(case: str) -> dict[str, Any]:
    """Save at ``SAVE_AT`` (model shards and ``opt.state_dict()``, copied), train on, then
    resume a fresh model and fresh optimizers from the copy: both runs' ends, and the resumed
    optimizers' step counts (DiLoCo's, the inner's) after loading."""
    import warnings

    model, opt = _build(case, "mesh")
    _train(model, opt, 0, SAVE_AT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the between-syncs warning: resuming is the point)
        saved = copy.deepcopy(
            (opt.state_dict(), [p.to_local().detach() for p in model.parameters()])
        )
    _train(model, opt, SAVE_AT, STEPS)  # the run that saved goes on
    opt.finish()
    out: dict[str, Any] = {"saver": _full(model)}
    again, fresh = _build(case, "mesh")
    sd, local = saved
    with torch.no_grad():
        for p, value in zip(again.parameters(), local):
            p.to_local().copy_(value)
    fresh.load_state_dict(sd)
    out["iterations"] = (fresh.iterations, fresh.wrapped.iterations)
    _train(again, fresh, SAVE_AT, STEPS)
    fresh.finish()
    out["full"] = _full(again)
    return out


def _resumed_sharded(case: str, path: str) -> dict[str, Any]:
    """:func:`_resumed` through DiLoCo's DCP checkpoint (``save_sharded`` / ``load_sharded``,
    which restores the model's shards too)."""
    model, opt = _build(case, "mesh")
    _train(model, opt, 0, SAVE_AT)
    opt.save_sharded(path)
    _train(model, opt, SAVE_AT, STEPS)
    opt.finish()
    out: dict[str, Any] = {"saver": _full(model)}
    again, fresh = _build(case, "mesh")
    fresh.load_sharded(path)
    out["iterations"] = (fresh.iterations, fresh.wrapped.iterations)
    _train(again, fresh, SAVE_AT, STEPS)
    fresh.finish()
    out["full"] = _full(again)
    return out


def _bundle(rank: int, world: int, path: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for case in CASES:
        for kind in ("mesh", "reference"):
            model, opt = _build(case, kind)
            _train(model, opt, 0, STEPS)
            opt.finish()
            out[case, kind] = _full(model)
            if kind == "mesh":
                out[case, "slots"] = _slots(model, opt.wrapped)
    for case in ("nesterov", "decay"):
        out[case, "resumed"] = _resumed(case)
        out[case, "resumed_dcp"] = _resumed_sharded(case, f"{path}/{case}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[Any, Any]]:
    path = str(tmp_path_factory.mktemp("mesh_sgd_dcp"))
    return spawn(_bundle, GROUPS * PER_GROUP, args=(path,), timeout=300)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_process_of_every_group_ends_with_one_model(runs, case):
    for kind in ("mesh", "reference"):
        first = runs[0][case, kind]
        for rank in range(GROUPS * PER_GROUP):
            assert torch.equal(runs[rank][case, kind], first), (kind, f"rank {rank}")


def test_momentum_zero_is_torchs_sgd_bit_for_bit(runs):
    for rank in range(GROUPS * PER_GROUP):
        assert torch.equal(runs[rank]["plain", "mesh"], runs[rank]["plain", "reference"])


@pytest.mark.parametrize("case", ["momentum", "nesterov", "decay"])
def test_keras_momentum_is_its_equivalent_within_the_derived_tolerance(runs, case):
    moved = runs[0][case, "mesh"] - torch.cat([p.reshape(-1) for p in _model().parameters()])
    assert moved.abs().max() > 100 * ATOL  # training moved the model far beyond the tolerance
    for rank in range(GROUPS * PER_GROUP):
        torch.testing.assert_close(
            runs[rank][case, "mesh"], runs[rank][case, "reference"], rtol=0, atol=ATOL
        )


@pytest.mark.parametrize("case", ["momentum", "nesterov", "decay"])
def test_momentum_slots_are_local_shard_dtensors_in_the_parameters_layout(runs, case):
    for rank in range(GROUPS * PER_GROUP):
        for i, entry in enumerate(runs[rank][case, "slots"]):
            assert entry["names"] == ["m"], (rank, i, entry["names"])
            layouts = [*entry["internal"], entry["get_slot"], entry["saved"]]
            assert len(entry["internal"]) == 1, (rank, i, entry["internal"])
            for lay in layouts:
                where = (rank, i, lay)
                assert lay["dtensor"] and lay["same_mesh"] and lay["same_placements"], where
                assert lay["global_shape"] and lay["local_shape"], where
                assert lay["local_numel"] * PER_GROUP == lay["full_numel"], where  # 1/k
                assert lay["storage_bytes"] == lay["local_numel"] * lay["itemsize"], where


def test_no_slot_with_momentum_zero(runs):
    for rank in range(GROUPS * PER_GROUP):
        for entry in runs[rank]["plain", "slots"]:
            assert entry["names"] == [] and entry["get_slot"] == {"dtensor": False}


@pytest.mark.parametrize("how", ["resumed", "resumed_dcp"])
@pytest.mark.parametrize("case", ["nesterov", "decay"])
def test_state_dict_round_trip_continues_bit_for_bit(runs, case, how):
    """``state_dict()``/``load_state_dict()``, and the DCP checkpoint (``save_sharded``/
    ``load_sharded``)."""
    for rank in range(GROUPS * PER_GROUP):
        resumed = runs[rank][case, how]
        assert resumed["iterations"] == (SAVE_AT, SAVE_AT), (rank, resumed["iterations"])
        # the run that saved: state_dict() rewrote its momentum in Keras' units (one rounding
        # of v), which the resumed run continues from, bit for bit
        assert torch.equal(resumed["full"], resumed["saver"]), f"rank {rank}"
        torch.testing.assert_close(resumed["full"], runs[rank][case, "mesh"], rtol=0, atol=ATOL)


# ---- torchft: the same groups, each process with its own manager ------------------------------
def _managed(rank: int, world: int, lighthouse: str) -> dict[Any, Any]:
    """The ``plain`` and ``decay`` cases with ``manager=`` as the cross-group channel (a
    manager per DiLoCo: one manager serves one optimizer's state)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    group = rank // PER_GROUP
    _MESH.append(
        init_device_mesh("cpu", (GROUPS, PER_GROUP), mesh_dim_names=("replicate", "shard"))
    )
    out: dict[Any, Any] = {}
    for case in ("plain", "decay"):
        for kind in ("mesh", "reference"):
            manager, _store = group_manager(  # the group's store lives until the next
                rank, world, lighthouse, replica_id=f"group{group}.{case}.{kind}",
                use_async_quorum=False,
            )  # fmt: skip
            try:
                model = _model()
                for layer in (model[0], model[2]):
                    fully_shard(layer, mesh=_MESH[0]["shard"])
                fully_shard(model, mesh=_MESH[0]["shard"])
                outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                opt = DiLoCo(_inner(model, case, kind), outer, H, manager=manager)
                _train(model, opt, 0, STEPS)
                opt.finish()
                out[case, kind] = _full(model)
            finally:
                manager.shutdown(wait=False)
    return out


@pytest.fixture(scope="module")
def managed() -> list[dict[Any, Any]]:
    from distoptim.ft import Lighthouse

    with Lighthouse(min_replicas=GROUPS) as lighthouse:
        return spawn(_managed, GROUPS * PER_GROUP, args=(lighthouse.address,), timeout=300)


def test_managed_groups_end_with_one_model_equal_to_the_equivalent_inner(managed, runs):
    for rank in range(GROUPS * PER_GROUP):
        for key in managed[0]:
            assert torch.equal(managed[rank][key], managed[0][key]), (key, f"rank {rank}")
        assert torch.equal(managed[rank]["plain", "mesh"], managed[rank]["plain", "reference"])
        torch.testing.assert_close(
            managed[rank]["decay", "mesh"], managed[rank]["decay", "reference"], rtol=0, atol=ATOL
        )
        # the manager averages what group=mesh averages, in the same order: the same model
        assert torch.equal(managed[rank]["decay", "mesh"], runs[rank]["decay", "mesh"])
