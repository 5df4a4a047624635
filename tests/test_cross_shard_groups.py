"""CrossShardOptimizer across replica groups of FSDP2 shards (HSDP): 2 groups x 2 processes.

One 4-rank spawn (gloo, CPU) on a 2-D mesh ``("replicate", "shard")``: the model is
``fully_shard``-ed over ``mesh["shard"]`` (FSDP2 reduce-scatters the gradient inside the
group), and ``CrossShardOptimizer(SGD/Adam, group=mesh)`` averages each process's local shard
of the gradient with its counterpart in the other group. The same spawn runs torch's own HSDP
-- ``fully_shard(model, mesh=mesh)`` over the 2-D mesh (FSDP2 with a replicate dimension
reduce-scatters inside the group and all-reduces across) and the same optimizer -- on the same
model and data, the unsharded configuration (every process the whole model, CrossShard over the
same cross-group channel) for the bytes, and the
construction errors. The parent checks every rank:

(a) every process of every group ends with one model: the gathered shards are bitwise equal on
    all four ranks; the same model over each cross-group channel (``group=mesh``, its
    replicate dimension's ``ProcessGroup``, ``group_assignment=[[0, 2], [1, 3]]``);
(b) the result is torch's HSDP result bitwise (SGD with momentum, Adam; uneven shards too).
    Why bitwise: both runs compute the same local gradients, reduce-scatter them the same way
    inside the group (FSDP2's own collective), then add the two groups' pieces -- one addition
    of two float32 numbers, commutative, the same in gloo's all-reduce and in CrossShard's --
    and divide by powers of two (exact); the inner optimizer then runs on identical ``DTensor``
    gradients. (With more than two groups the sums may associate differently: rounding-level
    differences, not tested here);
(c) the bytes each process sends per step are counted (``comm_stats.bytes_sent``, the ring
    model ``2 (n - 1) / n`` of the bucket bytes) and the gradient payload is exactly ``1/k`` of
    the unsharded group's; the rest is the buckets' fixed words (presence flags, sequence
    words), the same few bytes in both;
(d) configurations that cannot be one model, or that are not supported with ``DTensor``
    parameters, raise at construction, before any group is created (the TF path: at its
    call); counterparts laid out
    differently (FSDP2 in one group, tensor parallelism in the other) fail the first round's
    parameter-list agreement on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distoptim import CrossShardOptimizer
from distoptim.comm.stats import ring_allreduce_bytes
from distoptim.launch import spawn
from tests._support.groups import GROUPS, PER_GROUP, Attempts, laid_out_per_group, raised
from tests._support.groups import full as _full
from tests._support.groups import mesh as _mesh
from tests._support.groups import shard as _shard

pytestmark = pytest.mark.slow  # one 4-rank spawn

ROWS = 8  # a group's batch per step (each of its 2 processes takes 4 rows)
STEPS = 6
OPTIMIZERS = ["sgd", "adam"]
CHANNELS = ["process_group", "assignment"]  # besides group=mesh


def _model() -> nn.Module:
    torch.manual_seed(0)  # sizes divisible by k: every shard is exactly 1/k of the model
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def _uneven() -> nn.Module:
    torch.manual_seed(0)  # 10 and 5 rows over 2 processes: FSDP2's uneven shards (5/5, 3/2)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


MODELS = {"even": _model, "uneven": _uneven}


def _inner(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _batch(group: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * group + t)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 4, generator=g)


def _rows() -> slice:
    j = dist.get_rank() % PER_GROUP
    return slice(j * ROWS // PER_GROUP, (j + 1) * ROWS // PER_GROUP)


def _train(model: nn.Module, opt: Any, per_step: list[int] | None = None) -> None:
    for t in range(STEPS):
        x, y = _batch(dist.get_rank() // PER_GROUP, t)
        rows = _rows()
        opt.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        before = opt.comm_stats.bytes_sent if per_step is not None else 0
        opt.step()
        if per_step is not None:
            per_step.append(opt.comm_stats.bytes_sent - before)


def _hsdp_cross_shard(name: str, channel: str = "mesh", shape: str = "even") -> dict[str, Any]:
    """FSDP2 inside each group, CrossShardOptimizer across the groups over ``channel``: the
    2-D mesh, its replicate dimension's ProcessGroup, or a group_assignment."""
    mesh = _mesh()
    model = _shard(MODELS[shape](), mesh["shard"])
    across: dict[str, Any] = {
        "mesh": {"group": mesh},
        "process_group": {"group": mesh.get_group("replicate")},
        "assignment": {"group_assignment": [[0, 2], [1, 3]]},
    }[channel]
    opt = CrossShardOptimizer(_inner(model, name), **across)
    per_step: list[int] = []
    _train(model, opt, per_step)
    opt.finish()
    plan = opt.bucket_plan
    return {
        "full": _full(model),
        "per_step": per_step,
        "payload": sum(b.payload_bytes for b in plan.buckets),
        "bucket_bytes": sum(
            b.size * torch.empty((), dtype=b.dtype).element_size() for b in plan.buckets
        ),
        "num_shards": opt.num_shards,
    }


PASSES = 2  # backward passes per step in the accumulation case


def _accumulated(ours: bool) -> torch.Tensor:
    """``PASSES`` micro-batches per step, their gradients accumulated: CrossShard across the
    groups with ``backward_passes_per_step=PASSES`` (it divides the sum once), or torch's own
    HSDP with each micro-batch's loss divided by ``PASSES`` (the DDP habit)."""
    mesh = _mesh()
    model = _shard(_model(), mesh["shard"] if ours else mesh)
    inner = _inner(model, "adam")
    opt = CrossShardOptimizer(inner, group=mesh, backward_passes_per_step=PASSES) if ours else inner
    for t in range(STEPS):
        opt.zero_grad()
        for m in range(PASSES):
            x, y = _batch(dist.get_rank() // PER_GROUP, 100 * (m + 1) + t)
            loss = F.mse_loss(model(x[_rows()]), y[_rows()])
            (loss if ours else loss / PASSES).backward()
        opt.step()
    if ours:
        opt.finish()
    return _full(model)


def _torch_hsdp(name: str, shape: str = "even") -> torch.Tensor:
    """torch's own HSDP: FSDP2 over the 2-D mesh, the same optimizer, no wrapper."""
    model = _shard(MODELS[shape](), _mesh())
    opt = _inner(model, name)
    for t in range(STEPS):
        x, y = _batch(dist.get_rank() // PER_GROUP, t)
        rows = _rows()
        opt.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    return _full(model)


def _unsharded() -> dict[str, Any]:
    """The unsharded configuration, for its bytes: every process holds the whole model, and
    CrossShard all-reduces it over the same cross-group channel (what each of a group's ``k``
    processes sends when nothing shards the model inside the group)."""
    model = _model()
    opt = CrossShardOptimizer(_inner(model, "sgd"), group=_mesh()["replicate"])
    per_step: list[int] = []
    _train(model, opt, per_step)
    opt.finish()
    plan = opt.bucket_plan
    return {
        "per_step": per_step,
        "payload": sum(b.payload_bytes for b in plan.buckets),
        "bucket_bytes": sum(
            b.size * torch.empty((), dtype=b.dtype).element_size() for b in plan.buckets
        ),
    }


def _errors() -> dict[str, str]:
    """Configurations refused at construction (before any subgroup is created)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    attempt = Attempts()
    model = _shard(_model(), mesh["shard"])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    attempt("no_channel", lambda: CrossShardOptimizer(sgd))
    attempt("own_group", lambda: CrossShardOptimizer(sgd, group_assignment=[[0, 1], [2, 3]]))
    attempt("shard_dim", lambda: CrossShardOptimizer(sgd, group=mesh["shard"]))
    unnamed = init_device_mesh("cpu", (GROUPS, PER_GROUP))
    attempt("unnamed_mesh", lambda: CrossShardOptimizer(sgd, group=unnamed))
    attempt("not_a_group", lambda: CrossShardOptimizer(sgd, group=[[0, 2], [1, 3]]))
    attempt(
        "both",
        lambda: CrossShardOptimizer(sgd, group=mesh, group_assignment=[[0, 2], [1, 3]]),
    )
    for option, value in [
        ("shard_optimizer_state", True),
        ("overlap", True),
        ("gradient_as_bucket_view", True),
    ]:
        attempt(option, lambda o=option, v=value: CrossShardOptimizer(sgd, group=mesh, **{o: v}))
    mixed = _model()
    fully_shard(mixed[0], mesh=mesh["shard"])  # the first layer only
    attempt("mixed", lambda: CrossShardOptimizer(_inner(mixed, "sgd"), group=mesh))
    hsdp = _shard(_model(), mesh)  # FSDP2 over the 2-D mesh already all-reduces across groups
    attempt("hsdp_twice", lambda: CrossShardOptimizer(_inner(hsdp, "sgd"), group=mesh))
    x, y = _batch(0, 0)
    loss = F.mse_loss(model(x), y)
    tf = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group=mesh)
    attempt("compute_gradients", lambda: tf.compute_gradients(loss))
    pairs = [(torch.zeros_like(p), p) for p in model.parameters()]
    attempt("apply_gradients", lambda: tf.apply_gradients(pairs))
    return attempt.said


def _mismatched_layouts() -> str:
    """Group 0 shards with FSDP2, group 1 with TP: counterparts hold pieces of other shapes."""
    from distoptim.comm.guard import DesyncError

    mesh = _mesh()
    model = laid_out_per_group(_model(), lambda m: _shard(m, mesh["shard"]))
    opt = CrossShardOptimizer(_inner(model, "sgd"), group=mesh)
    x, y = _batch(0, 0)
    F.mse_loss(model(x), y).backward()
    return raised(opt.step, DesyncError)  # the first round: its parameter-list agreement


def _run(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name in OPTIMIZERS:
        out["cross_shard", name] = _hsdp_cross_shard(name)
        out["torch", name] = _torch_hsdp(name)
    out["uneven"] = _hsdp_cross_shard("adam", shape="uneven")["full"]
    out["torch", "uneven"] = _torch_hsdp("adam", shape="uneven")
    for channel in CHANNELS:
        out["channel", channel] = _hsdp_cross_shard("sgd", channel)["full"]
    out["unsharded"] = _unsharded()
    out["accumulated"] = _accumulated(ours=True)
    out["torch", "accumulated"] = _accumulated(ours=False)
    out["errors"] = _errors()
    out["mismatched"] = _mismatched_layouts()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[Any, Any]]:
    return spawn(_run, GROUPS * PER_GROUP, timeout=240)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_process_of_every_group_ends_with_one_model(runs, name):
    first = runs[0]["cross_shard", name]["full"]
    assert not torch.equal(first, _full(_model())), "training changed nothing"
    for rank, out in enumerate(runs):
        assert torch.equal(out["cross_shard", name]["full"], first), f"rank {rank} differs"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_equal_to_torchs_hsdp_bitwise(runs, name):
    for rank, out in enumerate(runs):
        ours, theirs = out["cross_shard", name]["full"], out["torch", name]
        assert torch.equal(ours, theirs), (
            f"rank {rank}: max |diff| {(ours - theirs).abs().max().item():.3g}"
        )


def test_uneven_shards_equal_torchs_hsdp_bitwise(runs):
    for rank, out in enumerate(runs):
        assert torch.equal(out["uneven"], out["torch", "uneven"]), rank
        assert torch.equal(out["uneven"], runs[0]["uneven"]), rank


@pytest.mark.parametrize("channel", CHANNELS)
def test_every_cross_group_channel_gives_the_same_model(runs, channel):
    for rank, out in enumerate(runs):
        assert torch.equal(out["channel", channel], out["cross_shard", "sgd"]["full"]), rank


def test_each_process_sends_one_kth_of_the_unsharded_groups_bytes(runs):
    model_bytes = sum(p.numel() for p in _model().parameters()) * 4  # fp32: 4P
    for rank, out in enumerate(runs):
        ours, unsharded = out["cross_shard", "sgd"], out["unsharded"]
        assert ours["num_shards"] == GROUPS
        # the gradient payload: 1/k of the model here, the whole model unsharded
        assert ours["payload"] * PER_GROUP == unsharded["payload"] == model_bytes, rank
        # the buckets' fixed words (presence flags, sequence words) are the same in both
        fixed = ours["bucket_bytes"] - ours["payload"]
        assert fixed == unsharded["bucket_bytes"] - unsharded["payload"], rank
        # every step after the first (which adds the parameter-list agreement) sends the ring
        # all-reduce of its buckets and nothing else: (1/k)(n-1)/n 2 4P, plus the fixed words
        per_step = ring_allreduce_bytes(model_bytes // PER_GROUP + fixed, GROUPS)
        assert ours["per_step"][1:] == [per_step] * (STEPS - 1), (rank, ours["per_step"])
        whole = ring_allreduce_bytes(model_bytes + fixed, GROUPS)
        assert unsharded["per_step"][1:] == [whole] * (STEPS - 1), (rank, unsharded["per_step"])


ERRORS = {
    "no_channel": "would average its shard",
    "own_group": "would average its shard",
    "shard_dim": "would average its shard",
    "unnamed_mesh": "'replicate'",
    "not_a_group": "group must be a DeviceMesh",
    "both": "not both",
    "shard_optimizer_state": "shard_optimizer_state=True",
    "overlap": "overlap=True",
    "gradient_as_bucket_view": "gradient_as_bucket_view=True",
    "mixed": "are plain tensors",
    "hsdp_twice": "would average its shard",
    "compute_gradients": "the TF path",
    "apply_gradients": "the TF path",
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_configurations_that_are_not_one_model_are_refused(runs, case):
    for rank, out in enumerate(runs):
        message = out["errors"][case]
        assert message.startswith("ValueError") or message.startswith("TypeError"), message
        assert ERRORS[case] in message, (rank, message)


def test_counterparts_laid_out_differently_fail_the_first_round(runs):
    for rank, out in enumerate(runs):
        message = out["mismatched"]
        assert message.startswith("ParameterMismatchError"), (rank, message)


def test_accumulated_passes_equal_torchs_hsdp_with_the_loss_divided(runs):
    """backward_passes_per_step=2 with FSDP2 inside the groups: FSDP2 accumulates each pass's
    reduce-scattered piece into .grad, CrossShard averages the sum across the groups and divides
    it by the passes once; torch's HSDP adds the passes' pieces after its all-reduce. The same
    sums in another order: float32 rounding, asserted within 1e-6 (measured 3e-8 after 6 Adam
    steps); every rank bitwise equal to every other."""
    first = runs[0]["accumulated"]
    assert not torch.equal(first, _full(_model())), "training changed nothing"
    for rank, out in enumerate(runs):
        assert torch.equal(out["accumulated"], first), f"rank {rank} differs"
        gap = (out["accumulated"] - out["torch", "accumulated"]).abs().max().item()
        assert gap <= 1e-6, (rank, gap)
