"""CrossShardOptimizer when ranks diverge: one correct result everywhere, or an error everywhere.

The divergent-rank matrix of issue 10, with overlap off and on: one rank edits ``.grad``,
drops a gradient, zero_grads, runs an extra ``backward()``, skips or adds a ``step()``, changes
its parameter list, or loaded another checkpoint. Each case either ends with the same
parameters on every rank -- equal to what ``overlap=False`` computes from the same edited
gradients -- or with ``DesyncError`` (``ParameterMismatchError``) on every rank, quickly: the
time from the divergent operation to the error is recorded and asserted far below the process
group timeout. The guard raises before anything is applied and every rank has issued the same
collectives, so the process group stays usable and one 2-rank spawn runs every case (a
``dist.all_reduce`` of the case number after each case proves the ranks are still paired).
The one case that ends the group -- a rank that returns early -- runs last; a rank that raises
between collectives has a spawn of its own.

The matrix also runs, with overlap on, with gradients as bucket views and with weight-update
sharding plus bucket views (reduce-scatter rounds whose sequence words travel in a control
message): every case must end as it does without them.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distoptim
from distoptim import CrossShardOptimizer, DesyncError
from distoptim.comm.fingerprint import ParameterMismatchError
from distoptim.launch import RankFailedError, spawn

ITERS = 6
FAST_S = 5.0  # "quickly": the process group timeout in these tests is 120 s


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + it)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(5, 3, generator=g, dtype=torch.float64)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


MODES: dict[str, dict[str, Any]] = {
    "views": {"gradient_as_bucket_view": True},
    "sharded": {"gradient_as_bucket_view": True, "shard_optimizer_state": True},
}
"""Extra modes the matrix runs with overlap on (keys ``name/mode``)."""


class Run:
    """One case on one rank: a model, its optimizer, and the training loop's pieces."""

    def __init__(self, rank: int, overlap: bool, **kwargs: Any) -> None:
        self.rank = rank
        self.model = _mlp().double()
        # one parameter per bucket: with overlap, backward launches all but the last bucket
        kwargs.setdefault("bucket_cap_mb", 1e-9)
        self.opt = CrossShardOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9),
            overlap=overlap,
            **kwargs,
        )

    def backward(self, it: int) -> None:
        x, y = _batch(self.rank, it)
        F.mse_loss(self.model(x), y).backward()

    def iteration(self, it: int, step: bool = True) -> None:
        self.opt.zero_grad()
        self.backward(it)
        if step:
            self.opt.step()


# A case is fn(run, rank, it), called once per iteration on every rank: it does that
# iteration's work (some ranks diverge at some iteration).
Case = Callable[[Run, int, int], None]


def _normal(run: Run, rank: int, it: int) -> None:
    run.iteration(it)


def _edit_noop_on_rank1(run: Run, rank: int, it: int) -> None:
    run.opt.zero_grad()
    run.backward(it)
    if rank == 1 and it == 2:
        for p in run.model.parameters():
            p.grad.mul_(1.0)  # no-op value, but an in-place edit after launch
    run.opt.step()


def _clip_on_rank1(run: Run, rank: int, it: int) -> None:
    run.opt.zero_grad()
    run.backward(it)
    if rank == 1 and it % 2 == 0:  # per-replica clipping on some ranks, some steps
        nn.utils.clip_grad_norm_(run.model.parameters(), 0.05)
    run.opt.step()


def _grad_none_on_rank1(run: Run, rank: int, it: int) -> None:
    run.opt.zero_grad()
    run.backward(it)
    if rank == 1 and it == 2:
        run.model[2].weight.grad = None
    run.opt.step()


def _zero_grad_on_rank1(run: Run, rank: int, it: int) -> None:
    run.opt.zero_grad()
    run.backward(it)
    if rank == 1 and it == 2:
        run.opt.zero_grad()
    run.opt.step()


def _extra_backward_on_rank1(run: Run, rank: int, it: int) -> None:
    run.opt.zero_grad()
    run.backward(it)
    if rank == 1 and it == 2:
        run.backward(it + 100)
    run.opt.step()


def _skip_step_middle(run: Run, rank: int, it: int) -> None:
    run.iteration(it, step=not (rank == 1 and it == 2))


def _paired_skips(run: Run, rank: int, it: int) -> None:
    # rank 1 skips at iteration 2, rank 0 at iteration 4: both take ITERS - 1 steps
    run.iteration(it, step=not ((rank == 1 and it == 2) or (rank == 0 and it == 4)))


def _extra_step_middle(run: Run, rank: int, it: int) -> None:
    run.iteration(it)
    if rank == 0 and it == 2:
        run.opt.step()


def _skip_last_step(run: Run, rank: int, it: int) -> None:
    run.iteration(it, step=not (rank == 1 and it == ITERS - 1))


def _extra_last_step(run: Run, rank: int, it: int) -> None:
    run.iteration(it)
    if rank == 0 and it == ITERS - 1:
        run.opt.step()


def _freeze_on_rank1(run: Run, rank: int, it: int) -> None:
    if rank == 1 and it == 2:
        run.model[2].bias.requires_grad_(False)
    run.iteration(it)


def _add_group_on_rank0(run: Run, rank: int, it: int) -> None:
    if rank == 0 and it == 2:
        run.opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
    run.iteration(it)


def _checkpoint_on_rank1(run: Run, rank: int, it: int) -> None:
    if it == 2:  # saved on every rank (gathering a sharded state is a collective) ...
        run.opt.consolidate_state_dict(to=None)
        sd = run.opt.state_dict()
        if rank == 1:  # ... but loaded on some ranks only
            sd["iterations"] = 0
            run.opt.load_state_dict(sd)
    run.iteration(it)


def _freeze_everywhere(run: Run, rank: int, it: int) -> None:
    if it == 2:
        run.model[2].bias.requires_grad_(False)
    if it == 3:
        run.opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
    run.iteration(it)


def _grad_scaler_everywhere(run: Run, rank: int, it: int) -> None:
    scaler = run.__dict__.setdefault("scaler", torch.amp.GradScaler("cpu", init_scale=1024.0))
    run.opt.zero_grad()
    x, y = _batch(rank, it)
    scaler.scale(F.mse_loss(run.model(x), y)).backward()
    scaler.unscale_(run.opt)  # edits .grad on every rank after backward launched it
    nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    scaler.step(run.opt)
    scaler.update()


def _grad_scaler_inf_on_rank1(run: Run, rank: int, it: int) -> None:
    scaler = run.__dict__.setdefault("scaler", torch.amp.GradScaler("cpu", init_scale=1024.0))
    run.opt.zero_grad()
    x, y = _batch(rank, it)
    loss = F.mse_loss(run.model(x), y)
    if rank == 1 and it == 2:
        loss = loss * float("inf")  # an overflow on one rank: its scaler skips opt.step()
    scaler.scale(loss).backward()
    scaler.step(run.opt)
    scaler.update()


# name -> (case, Run kwargs per rank, expected outcome: "equal" or the error type)
CASES: dict[str, tuple[Case, Callable[[int], dict[str, Any]], str]] = {
    "edit_noop_one_rank": (_edit_noop_on_rank1, lambda r: {}, "equal"),
    "clip_one_rank": (_clip_on_rank1, lambda r: {}, "equal"),
    "grad_none_one_rank": (_grad_none_on_rank1, lambda r: {}, "equal"),
    "zero_grad_one_rank": (_zero_grad_on_rank1, lambda r: {}, "equal"),
    "grad_scaler_every_rank": (_grad_scaler_everywhere, lambda r: {}, "equal"),
    "freeze_and_add_every_rank": (_freeze_everywhere, lambda r: {}, "equal"),
    "grad_scaler_inf_one_rank": (_grad_scaler_inf_on_rank1, lambda r: {}, "DesyncError"),
    "extra_backward_one_rank": (_extra_backward_on_rank1, lambda r: {}, "DesyncError"),
    "extra_backward_guard_off": (
        _extra_backward_on_rank1,
        lambda r: {"sequence_guard": False},
        "equal",
    ),
    "skip_step_middle": (_skip_step_middle, lambda r: {}, "DesyncError"),
    "paired_skips": (_paired_skips, lambda r: {}, "DesyncError"),
    "extra_step_middle": (_extra_step_middle, lambda r: {}, "DesyncError"),
    "skip_last_step_then_finish": (_skip_last_step, lambda r: {}, "DesyncError"),
    "extra_last_step_then_finish": (_extra_last_step, lambda r: {}, "DesyncError"),
    "checkpoint_one_rank": (_checkpoint_on_rank1, lambda r: {}, "DesyncError"),
    "freeze_one_rank": (_freeze_on_rank1, lambda r: {}, "ParameterMismatchError"),
    "add_param_group_one_rank": (_add_group_on_rank0, lambda r: {}, "ParameterMismatchError"),
    "different_backward_passes_per_step": (
        _normal,
        lambda r: {"backward_passes_per_step": 1 + r},
        "ParameterMismatchError",
    ),
    "undisturbed": (_normal, lambda r: {}, "equal"),
}


def _play(rank: int, name: str, overlap: bool, mode: str = "plain") -> dict[str, Any]:
    """Run case ``name`` on this rank; what happened, and how fast an error came."""
    case, kwargs, _ = CASES[name]
    run = Run(rank, overlap, **kwargs(rank), **MODES.get(mode, {}))
    result: dict[str, Any] = {"error": None}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "reducing .grad again" warning
        try:
            for it in range(ITERS):
                t0 = time.perf_counter()  # the error must come within the iteration it shows
                case(run, rank, it)
            t0 = time.perf_counter()
            run.opt.finish()
        except DesyncError as exc:  # ParameterMismatchError is one too
            result["error"] = type(exc).__name__
            result["message"] = str(exc)
            result["seconds"] = time.perf_counter() - t0
    result["flat"] = _flat(run.model)
    result["iterations"] = run.opt.iterations
    result["repeated"] = run.opt.comm_stats.repeated_rounds
    return result


def _still_paired(index: int) -> bool:
    """Both ranks reach the same next collective: the group survived the case."""
    t = torch.tensor([index, -index], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist() == [index, -index]


def _matrix(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    index = 0
    for overlap in (False, True):
        for name in CASES:
            index += 1
            out[f"{name}/overlap={overlap}"] = _play(rank, name, overlap)
            out[f"{name}/overlap={overlap}/paired"] = _still_paired(index)
    for mode in MODES:
        for name in CASES:
            index += 1
            out[f"{name}/{mode}"] = _play(rank, name, True, mode)
            out[f"{name}/{mode}/paired"] = _still_paired(index)
    # last: rank 1 leaves without its last step(); rank 0 learns it at once, not at the timeout
    run = Run(rank, overlap=True)
    t0 = time.perf_counter()
    try:
        for it in range(ITERS):
            t0 = time.perf_counter()
            run.iteration(it, step=not (rank == 1 and it == ITERS - 1))
        out["peer_left"] = {"error": None}
    except DesyncError as exc:
        out["peer_left"] = {"error": str(exc), "seconds": time.perf_counter() - t0}
    return out


@pytest.fixture(scope="module")
def matrix() -> list[dict[str, Any]]:
    return spawn(_matrix, 2, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["overlap=False", "overlap=True", *MODES])
@pytest.mark.parametrize("name", list(CASES))
def test_divergent_rank_matrix(matrix: list[dict[str, Any]], name: str, mode: str) -> None:
    expected = CASES[name][2]
    outs = [m[f"{name}/{mode}"] for m in matrix]
    assert all(m[f"{name}/{mode}/paired"] for m in matrix)  # the group is usable
    if expected == "equal":
        assert [o["error"] for o in outs] == [None, None], outs[0].get("message")
        assert torch.equal(outs[0]["flat"], outs[1]["flat"])  # replicas identical
        assert outs[0]["iterations"] == outs[1]["iterations"] == ITERS
        # overlap never changes what is applied: the same as reducing the edited .grad
        plain = matrix[0][f"{name}/overlap=False"]["flat"]
        assert torch.allclose(outs[0]["flat"], plain, rtol=1e-12, atol=1e-12)
        assert outs[0]["repeated"] == outs[1]["repeated"]  # any re-reduction was agreed
    else:
        assert [o["error"] for o in outs] == [expected, expected], outs
        assert all(o["seconds"] < FAST_S for o in outs), [o["seconds"] for o in outs]
        assert outs[0]["message"] == outs[1]["message"]  # every rank names the same table
        assert "rank 0:" in outs[0]["message"] and "rank 1:" in outs[0]["message"]
        # nothing was applied by the round that raised: replicas are still identical
        assert torch.equal(outs[0]["flat"], outs[1]["flat"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_edits_after_launch_are_reduced_again_on_every_rank(
    matrix: list[dict[str, Any]],
) -> None:
    for name in ("edit_noop_one_rank", "clip_one_rank", "zero_grad_one_rank"):
        outs = [m[f"{name}/overlap=True"] for m in matrix]
        assert outs[0]["repeated"] >= 1 and outs[0]["repeated"] == outs[1]["repeated"], name
    # a no-op edit changes nothing: the result is the undisturbed run's
    base = matrix[0]["undisturbed/overlap=False"]["flat"]
    assert torch.allclose(
        matrix[0]["edit_noop_one_rank/overlap=True"]["flat"], base, rtol=1e-12, atol=1e-12
    )
    # ... while the clipping case really differs from it (the test can fail)
    assert not torch.allclose(matrix[0]["clip_one_rank/overlap=True"]["flat"], base)
    # with overlap off nothing is reduced twice, except to adopt a new parameter list
    for name, (_, _, expected) in CASES.items():
        if expected == "equal":
            repeated = 2 if name == "freeze_and_add_every_rank" else 0
            assert matrix[0][f"{name}/overlap=False"]["repeated"] == repeated, name
    assert matrix[0]["freeze_and_add_every_rank/overlap=True"]["repeated"] == 2


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_error_messages_say_what_diverged(matrix: list[dict[str, Any]]) -> None:
    def message(name: str) -> str:
        return matrix[0][f"{name}/overlap=True"]["message"]

    assert "1 backward pass since" in message("extra_backward_one_rank")
    assert "2 backward passes since" in message("extra_backward_one_rank")
    assert "an extra backward()" in message("skip_step_middle")
    assert "finish()" in message("skip_last_step_then_finish")
    assert "step counters differ" in message("checkpoint_one_rank")
    assert "requires_grad_() change or add_param_group() on some ranks" in message(
        "freeze_one_rank"
    )
    assert "ranks disagree" in message("different_backward_passes_per_step")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_peer_that_leaves_ends_the_wait_at_once(matrix: list[dict[str, Any]]) -> None:
    left = matrix[0]["peer_left"]
    assert left["error"] is not None and left["seconds"] < FAST_S
    assert "A peer stopped taking part" in left["error"]
    assert "rank 0" in left["error"]
    assert matrix[1]["peer_left"]["error"] is None  # rank 1 returned before its last step


# ---------------------------------------------------------------------------------------------
# a rank that raises between collectives: the caller gets that exception
# ---------------------------------------------------------------------------------------------
def _raise_between_collectives(rank: int, world: int) -> None:
    run = Run(rank, overlap=True)
    for it in range(ITERS):
        run.opt.zero_grad()
        run.backward(it)
        if rank == 1 and it == 2:
            raise ValueError(f"user code failed at {time.time():.6f}")
        run.opt.step()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_exception_between_collectives_reaches_the_caller() -> None:
    t0 = time.perf_counter()
    with pytest.raises(RankFailedError) as info:
        spawn(_raise_between_collectives, 2, timeout=120)
    assert time.perf_counter() - t0 < 60  # not the timeout
    text = str(info.value)
    assert "ValueError: user code failed at" in text.splitlines()[0], text
    raised_at = float(text.split("user code failed at ")[1].split()[0].rstrip("'\""))
    assert time.time() - raised_at < 30


def test_desync_error_is_public() -> None:
    assert distoptim.DesyncError is DesyncError
    assert issubclass(ParameterMismatchError, DesyncError)
    assert issubclass(DesyncError, RuntimeError)
