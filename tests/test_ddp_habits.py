"""CrossShardOptimizer under a DDP user's habits: each one right, or loud (issue 18).

* clipping the *averaged* gradient: ``synchronize()`` then ``clip_grad_norm_``, or
  ``max_grad_norm=``, equals real ``DistributedDataParallel`` + ``clip_grad_norm_`` bit for bit
  (with ``.grad`` in tensors of its own, in bucket views, with overlap); with weight-update
  sharding ``max_grad_norm`` is equal up to the norm's summation order;
* an edit of ``.grad`` between ``backward()`` and ``step()`` without ``synchronize()`` warns
  once on every rank, pointing at the user's line;
* a model wrapped in DDP (its gradients reduced twice) warns once on every rank;
* hyperparameters that differ between ranks (an LR scheduler stepped on rank 0 only, another
  momentum) raise ``DesyncError`` on every rank, nothing applied;
* collective calls made on some ranks only (``consolidate_state_dict()``, sharded
  ``get_slot()``, ``save_sharded()``, ``finish()``) raise ``DesyncError`` within seconds on
  every rank involved;
* sparse gradients are densified in every mode; a backward that reaches none of the pass
  counter's sentinels is no false alarm; a wrong-shaped ``.grad`` and an absurd
  ``bucket_cap_mb`` are named.

Two 2-rank spawns run every multi-rank case (as ``tests/test_desync.py`` does: a case that
raises leaves the group paired, checked by one all-reduce after it): one for what must be right
or raise in the round where it shows, one for the collective calls made on some ranks only
(which hung until the process group's timeout before), ending with the case that ends the group
(a lone ``consolidate_state_dict()`` whose peer returned). Each part of a bundle records an
unexpected exception instead of raising, so each test fails for its own reason.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distoptim import CrossShardOptimizer, DesyncError
from distoptim.launch import spawn

STEPS = 4
CLIP = 0.05  # far below the gradients' norm: every step clips
FAST_S = 5.0  # "within seconds": the process group timeout here is 120 s


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).to(dtype)


def _batch(rank: int, it: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * rank + it)
    return torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _still_paired(index: int) -> bool:
    t = torch.tensor([index, -index], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist() == [index, -index]


def _messages(caught: list[warnings.WarningMessage], needle: str) -> list[tuple[str, str]]:
    return [(str(w.message), w.filename) for w in caught if needle in str(w.message)]


# ---------------------------------------------------------------------------------------------
# clipping the averaged gradient, against real DDP
# ---------------------------------------------------------------------------------------------
def _ddp_reference(rank: int) -> torch.Tensor:
    model = nn.parallel.DistributedDataParallel(_mlp())
    opt = _sgd(model.parameters())
    for it in range(STEPS):
        opt.zero_grad()
        x, y = _batch(rank, it)
        F.mse_loss(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return _flat(model.module)


CONTENDERS: dict[str, tuple[dict[str, Any], bool]] = {
    # name -> (options, synchronize() and clip_grad_norm_ by hand)
    "sync/packed": ({}, True),
    "sync/views": ({"gradient_as_bucket_view": True}, True),
    "sync/packed/overlap": ({"overlap": True}, True),
    "sync/views/overlap": ({"gradient_as_bucket_view": True, "overlap": True}, True),
    "max_grad_norm/packed": ({"max_grad_norm": CLIP}, False),
    "max_grad_norm/views/overlap": (
        {"max_grad_norm": CLIP, "gradient_as_bucket_view": True, "overlap": True},
        False,
    ),
    "max_grad_norm/sharded": ({"max_grad_norm": CLIP, "shard_optimizer_state": True}, False),
    "max_grad_norm/sharded/views": (
        {"max_grad_norm": CLIP, "shard_optimizer_state": True, "gradient_as_bucket_view": True},
        False,
    ),
}


def _clip_averaged(rank: int, out: dict[str, Any]) -> None:
    out["ddp"] = _ddp_reference(rank)
    for name, (options, by_hand) in CONTENDERS.items():
        model = _mlp()
        opt = CrossShardOptimizer(_sgd(model.parameters()), bucket_cap_mb=1e-4, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for it in range(STEPS):
                opt.zero_grad()
                x, y = _batch(rank, it)
                F.mse_loss(model(x), y).backward()
                if by_hand:
                    opt.synchronize()
                    opt.synchronize()  # a second call does nothing
                    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
        out[name] = _flat(model)
        out[f"{name}/warnings"] = [str(w.message) for w in caught]
        opt.remove_hooks()
    # the old habit, clipping after backward without synchronize(), on rank 1 only: a
    # per-replica clip (different from DDP), and one warning on every rank, at this file's line
    for overlap in (False, True):
        model = _mlp()
        opt = CrossShardOptimizer(_sgd(model.parameters()), overlap=overlap)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for it in range(STEPS):
                opt.zero_grad()
                x, y = _batch(rank, it)
                F.mse_loss(model(x), y).backward()
                if rank == 1:
                    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
        out[f"local_clip/overlap={overlap}"] = _flat(model)
        out[f"local_clip/overlap={overlap}/warnings"] = _messages(caught, "LOCAL gradient")
        opt.remove_hooks()
    # synchronize() then backward() before step(): an error, not a silent local gradient
    model = _mlp()
    opt = CrossShardOptimizer(_sgd(model.parameters()))
    x, y = _batch(rank, 0)
    F.mse_loss(model(x), y).backward()
    opt.synchronize()
    F.mse_loss(model(x), y).backward()
    try:
        opt.step()
        out["backward_after_sync"] = "no error"
    except RuntimeError as exc:
        out["backward_after_sync"] = str(exc)
    # synchronize() is refused with sharding, before any collective
    opt = CrossShardOptimizer(_sgd(model.parameters()), shard_optimizer_state=True)
    try:
        opt.synchronize()
        out["sync_sharded"] = "no error"
    except TypeError as exc:
        out["sync_sharded"] = str(exc)


def _scaler_after_synchronize(rank: int, out: dict[str, Any]) -> None:
    """An overflow on rank 1 only: after synchronize() every rank sees it and skips."""
    model = _mlp(torch.float64)
    opt = CrossShardOptimizer(_sgd(model.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for it in range(STEPS):
            opt.zero_grad()
            x, y = _batch(rank, it, torch.float64)
            loss = F.mse_loss(model(x), y)
            if rank == 1 and it == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.finish()
    out["scaler"] = _flat(model)
    out["scaler/iterations"] = opt.iterations
    out["scaler/warnings"] = [str(w.message) for w in caught if "CrossShard" in str(w.message)]


# ---------------------------------------------------------------------------------------------
# a DDP model wrapped again
# ---------------------------------------------------------------------------------------------
def _double_reduce(rank: int, out: dict[str, Any]) -> None:
    for name, ddp_kwargs, options in (
        ("ddp", {}, {}),
        ("ddp_views/overlap", {"gradient_as_bucket_view": True}, {"overlap": True}),
    ):
        ddp = nn.parallel.DistributedDataParallel(_mlp(), **ddp_kwargs)
        opt = CrossShardOptimizer(_sgd(ddp.parameters()), **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for it in range(STEPS):
                opt.zero_grad()
                x, y = _batch(rank, it)
                F.mse_loss(ddp(x), y).backward()
                opt.step()
        out[f"double/{name}"] = _flat(ddp.module)
        out[f"double/{name}/warnings"] = _messages(caught, "DistributedDataParallel")
        opt.remove_hooks()
    model = _mlp()
    opt = CrossShardOptimizer(_sgd(model.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for it in range(STEPS):
            opt.zero_grad()
            x, y = _batch(rank, it)
            F.mse_loss(model(x), y).backward()
            opt.step()
    out["double/plain"] = _flat(model)
    out["double/plain/warnings"] = [str(w.message) for w in caught]


# ---------------------------------------------------------------------------------------------
# cases that raise: every rank, quickly, nothing applied, the group still paired
# ---------------------------------------------------------------------------------------------
def _scheduler_on_rank0(rank: int, options: dict[str, Any]) -> Callable[[], None]:
    model = _mlp(torch.float64)
    opt = CrossShardOptimizer(_sgd(model.parameters()), **options)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def run() -> None:
        for it in range(STEPS):
            opt.zero_grad()
            x, y = _batch(rank, it, torch.float64)
            F.mse_loss(model(x), y).backward()
            opt.step()
            if rank == 0:
                sched.step()

    return run


def _momentum_differs(rank: int, options: dict[str, Any]) -> Callable[[], None]:
    model = _mlp(torch.float64)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if rank == 0 else 0.8)
    opt = CrossShardOptimizer(inner, **options)

    def run() -> None:
        x, y = _batch(rank, 0, torch.float64)
        F.mse_loss(model(x), y).backward()
        opt.step()

    return run


def _save_alone(opt: CrossShardOptimizer) -> None:
    with tempfile.TemporaryDirectory() as root:
        opt.save_sharded(Path(root) / "checkpoint")


def _lone_call(call: str) -> Callable[[int, dict[str, Any]], Callable[[], None]]:
    """Rank 0 makes ``call`` after its second step; rank 1 steps on (or calls finish())."""

    def make(rank: int, options: dict[str, Any]) -> Callable[[], None]:
        model = _mlp(torch.float64)
        opt = CrossShardOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.01), shard_optimizer_state=True, **options
        )

        def step(it: int) -> None:
            opt.zero_grad()
            x, y = _batch(rank, it, torch.float64)
            F.mse_loss(model(x), y).backward()
            opt.step()

        def run() -> None:
            for it in range(2):
                step(it)
            if rank == 0:
                {
                    "consolidate": opt.consolidate_state_dict,
                    "get_slot": lambda: opt.get_slot(model[0].weight, "exp_avg"),
                    "finish": opt.finish,
                    "save_sharded": lambda: _save_alone(opt),
                }[call.split("/")[0]]()
            elif call.endswith("/peer_finishes"):
                opt.finish()
            else:
                step(2)

        return run

    return make


def _wrong_shape(rank: int, options: dict[str, Any]) -> Callable[[], None]:
    model = _mlp(torch.float64)
    opt = CrossShardOptimizer(_sgd(model.parameters()), **options)

    def run() -> None:
        x, y = _batch(rank, 0, torch.float64)
        F.mse_loss(model(x), y).backward()
        model[4].bias.grad.data = torch.zeros(5, dtype=torch.float64)  # every rank, bucket 0
        opt.step()

    return run


Maker = Callable[[int, dict[str, Any]], Callable[[], None]]
RAISING: dict[str, tuple[Maker, type]] = {
    "scheduler_on_rank0": (_scheduler_on_rank0, DesyncError),
    "momentum_differs": (_momentum_differs, DesyncError),
    "wrong_shaped_grad": (_wrong_shape, ValueError),
}
CALLS: dict[str, tuple[Maker, type]] = {
    "consolidate_on_rank0": (_lone_call("consolidate"), DesyncError),
    "consolidate_on_rank0/peer_finishes": (_lone_call("consolidate/peer_finishes"), DesyncError),
    "get_slot_on_rank0": (_lone_call("get_slot"), DesyncError),
    "finish_on_rank0": (_lone_call("finish"), DesyncError),
    "save_sharded_on_rank0": (_lone_call("save_sharded"), DesyncError),
}
RAISING_MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "overlap": {"overlap": True},
    "sharded": {"shard_optimizer_state": True, "gradient_as_bucket_view": True},
}


def _play_raising(rank: int, out: dict[str, Any], cases: dict[str, tuple[Maker, type]]) -> None:
    index = 0
    for mode, options in RAISING_MODES.items():
        for name, (make, _) in cases.items():
            extra = dict(options)
            if cases is CALLS:
                extra.pop("shard_optimizer_state", None)  # these cases shard anyway
            index += 1
            run = make(rank, extra)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                try:
                    run()
                    result: dict[str, Any] = {"error": None}
                except Exception as exc:  # the tests compare the type
                    result = {
                        "error": type(exc).__name__,
                        "message": str(exc),
                        "seconds": time.perf_counter() - t0,
                    }
            out[f"raise/{name}/{mode}"] = result
            out[f"raise/{name}/{mode}/paired"] = _still_paired(index)


def _raising(rank: int, out: dict[str, Any]) -> None:
    _play_raising(rank, out, RAISING)


def _calls(rank: int, out: dict[str, Any]) -> None:
    _play_raising(rank, out, CALLS)


# ---------------------------------------------------------------------------------------------
# sparse gradients, and a backward that reaches no sentinel
# ---------------------------------------------------------------------------------------------
SPARSE_MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "overlap": {"overlap": True},
    "views": {"gradient_as_bucket_view": True},
    "views/overlap": {"gradient_as_bucket_view": True, "overlap": True},
    "sharded": {"shard_optimizer_state": True},
    "sharded/views/overlap": {
        "shard_optimizer_state": True,
        "gradient_as_bucket_view": True,
        "overlap": True,
    },
}


def _sparse(rank: int, out: dict[str, Any]) -> None:
    for mode, options in SPARSE_MODES.items():
        for sparse in (True, False):
            torch.manual_seed(0)
            emb = nn.Embedding(10, 3, sparse=sparse)
            head = nn.Linear(3, 1)
            params = [*emb.parameters(), *head.parameters()]
            opt = CrossShardOptimizer(torch.optim.SGD(params, lr=0.1), **options)
            try:
                for it in range(STEPS):
                    opt.zero_grad()
                    idx = torch.tensor([rank, 3 + it, 7])
                    F.mse_loss(head(emb(idx)), torch.ones(3, 1)).backward()
                    opt.step()
                out[f"sparse/{mode}/{sparse}"] = torch.cat([p.detach().reshape(-1) for p in params])
            except RuntimeError as exc:
                out[f"sparse/{mode}/{sparse}"] = str(exc)
            opt.remove_hooks()


class Experts(nn.Module):
    """Eight parameters, each its own branch: a rank may use any subset of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.experts = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(8)])

    def loss(self, x: torch.Tensor, used: list[int]) -> torch.Tensor:
        return sum(((x * self.experts[i]).sum() - i) ** 2 for i in used)  # type: ignore[return-value]


def _unseen_pass(rank: int, out: dict[str, Any]) -> None:
    # the pass counter watches parameters 0, 2, 5 and 7 of 8; rank 1 uses none of them
    used = list(range(8)) if rank == 0 else [1, 3, 4, 6]
    for overlap in (False, True):
        model = Experts()
        opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), overlap=overlap)
        try:
            for it in range(STEPS):
                opt.zero_grad()
                model.loss(torch.full((3,), 1.0 + it), used).backward()
                opt.step()
            opt.finish()
            out[f"unseen/overlap={overlap}"] = _flat(model)
        except DesyncError as exc:
            out[f"unseen/overlap={overlap}"] = str(exc)
        opt.remove_hooks()
    # an extra step() with nothing new in .grad is still found (no pass, nothing changed)
    model = Experts()
    opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    try:
        for it in range(STEPS):
            opt.zero_grad()
            model.loss(torch.full((3,), 1.0 + it), used).backward()
            opt.step()
            if rank == 1 and it == 1:
                opt.step()
        opt.finish()
        out["unseen/extra_step"] = "no error"
    except DesyncError as exc:
        out["unseen/extra_step"] = str(exc)
    out["unseen/extra_step/paired"] = _still_paired(1000)


# ---------------------------------------------------------------------------------------------
# the bundle
# ---------------------------------------------------------------------------------------------
def _parts(rank: int, parts: tuple[Callable[[int, dict[str, Any]], None], ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        try:
            part(rank, out)
        except Exception as exc:  # recorded: the part's tests fail with it
            out[f"{part.__name__}/crashed"] = f"{type(exc).__name__}: {exc}"
    return out


def _bundle(rank: int, world: int) -> dict[str, Any]:
    parts = (_clip_averaged, _scaler_after_synchronize, _double_reduce, _sparse, _unseen_pass)
    return _parts(rank, (*parts, _raising))


def _calls_bundle(rank: int, world: int) -> dict[str, Any]:
    out = _parts(rank, (_calls,))
    # last: rank 0 alone gathers the sharded state, rank 1 returns (its group goes away)
    model = _mlp(torch.float64)
    opt = CrossShardOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), shard_optimizer_state=True
    )
    for it in range(2):
        opt.zero_grad()
        x, y = _batch(rank, it, torch.float64)
        F.mse_loss(model(x), y).backward()
        opt.step()
    out["lone"] = {"error": None}
    if rank == 0:
        t0 = time.perf_counter()
        try:
            opt.consolidate_state_dict()
        except DesyncError as exc:
            out["lone"] = {"error": str(exc), "seconds": time.perf_counter() - t0}
    return out


@pytest.fixture(scope="module")
def bundle() -> list[dict[str, Any]]:
    return spawn(_bundle, 2, timeout=120)


@pytest.fixture(scope="module")
def calls() -> list[dict[str, Any]]:
    return spawn(_calls_bundle, 2, timeout=120)


def _intact(outs: list[dict[str, Any]], part: Callable[..., None]) -> None:
    for out in outs:
        assert f"{part.__name__}/crashed" not in out, out[f"{part.__name__}/crashed"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONTENDERS))
def test_clipping_the_averaged_gradient_equals_ddp(bundle: list[dict[str, Any]], name: str) -> None:
    _intact(bundle, _clip_averaged)
    ddp = bundle[0]["ddp"]
    assert torch.equal(ddp, bundle[1]["ddp"])
    for out in bundle:
        if "sharded" in name:  # the norm is summed shard by shard: rounding differs
            assert torch.allclose(out[name], ddp, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(out[name], ddp), (out[name] - ddp).abs().max()
        assert out[f"{name}/warnings"] == []  # nothing was edited locally
    # clipping matters here: the per-replica clip of the old habit gives something else
    assert not torch.allclose(bundle[0]["local_clip/overlap=False"], ddp, atol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_local_edit_warns_once_on_every_rank_at_the_users_line(
    bundle: list[dict[str, Any]], overlap: bool
) -> None:
    _intact(bundle, _clip_averaged)
    for out in bundle:
        warned = out[f"local_clip/overlap={overlap}/warnings"]
        assert len(warned) == 1, warned  # once, although rank 1 clips every step
        message, filename = warned[0]
        assert "on rank(s) [1]" in message and "opt.synchronize()" in message
        assert "max_grad_norm" in message
        assert filename == __file__  # the user's opt.step() line, not distoptim's
    assert torch.equal(
        bundle[0][f"local_clip/overlap={overlap}"], bundle[1][f"local_clip/overlap={overlap}"]
    )


@pytest.mark.timeout(300)
def test_synchronize_misuse_is_named(bundle: list[dict[str, Any]]) -> None:
    _intact(bundle, _clip_averaged)
    for out in bundle:
        assert "backward() ran between synchronize() and step()" in out["backward_after_sync"]
        assert "max_grad_norm" in out["sync_sharded"]


@pytest.mark.timeout(300)
def test_after_synchronize_a_grad_scaler_skips_on_every_rank_alike(
    bundle: list[dict[str, Any]],
) -> None:
    _intact(bundle, _scaler_after_synchronize)
    assert torch.equal(bundle[0]["scaler"], bundle[1]["scaler"])
    for out in bundle:
        assert out["scaler/iterations"] == STEPS - 1  # the overflowing step skipped everywhere
        assert out["scaler/warnings"] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["ddp", "ddp_views/overlap"])
def test_a_ddp_model_wrapped_again_warns_on_every_rank(
    bundle: list[dict[str, Any]], name: str
) -> None:
    _intact(bundle, _double_reduce)
    for out in bundle:
        warned = out[f"double/{name}/warnings"]
        assert len(warned) == 1, warned
        assert "on rank(s) [0, 1]" in warned[0][0] and "no_sync()" in warned[0][0]
        assert warned[0][1] == __file__
        # the update itself is right (reduced twice, the same mean)
        assert torch.allclose(out[f"double/{name}"], out["double/plain"], rtol=1e-6, atol=1e-7)
        assert out["double/plain/warnings"] == []


def _raised(outs: list[dict[str, Any]], name: str, mode: str, expected: type) -> str:
    """Both ranks raised ``expected`` quickly and are still paired; rank 0's message."""
    results = [o[f"raise/{name}/{mode}"] for o in outs]
    assert [r["error"] for r in results] == [expected.__name__] * 2, results
    assert all(r["seconds"] < FAST_S for r in results), [r["seconds"] for r in results]
    assert all(o[f"raise/{name}/{mode}/paired"] for o in outs)  # the group is usable
    return str(results[0]["message"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(RAISING_MODES))
@pytest.mark.parametrize("name", list(RAISING))
def test_other_hyperparameters_or_a_wrong_grad_raise_on_every_rank(
    bundle: list[dict[str, Any]], name: str, mode: str
) -> None:
    _intact(bundle, _raising)
    message = _raised(bundle, name, mode, RAISING[name][1])
    if name == "wrong_shaped_grad":
        assert "trainable parameter 5" in message
        assert "has shape (5,), but the parameter has shape (3,)" in message
    else:
        assert "different hyperparameters" in message and "ranks [0] / ranks [1]" in message
        difference = {
            "scheduler_on_rank0": "group 0: lr: rank 0 0.05, rank 1 0.1",
            "momentum_differs": "group 0: momentum: rank 0 0.9, rank 1 0.8",
        }[name]
        assert message.endswith(difference), message
        assert message == bundle[1][f"raise/{name}/{mode}"]["message"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(RAISING_MODES))
@pytest.mark.parametrize("name", list(CALLS))
def test_a_collective_call_on_some_ranks_raises_on_every_rank_quickly(
    calls: list[dict[str, Any]], name: str, mode: str
) -> None:
    _intact(calls, _calls)
    message = _raised(calls, name, mode, CALLS[name][1])
    words = {"consolidate": "consolidate_state_dict()", "get_slot": "get_slot()",
             "finish": "finish()", "save_sharded": "save_sharded()"}  # fmt: skip
    word = next(v for k, v in words.items() if name.startswith(k))
    assert word in message and "called on rank(s) [0] only" in message
    assert "every rank must call it" in message
    assert message == calls[1][f"raise/{name}/{mode}"]["message"]


@pytest.mark.timeout(300)
def test_a_lone_collective_call_whose_peer_left_ends_at_once(
    calls: list[dict[str, Any]],
) -> None:
    lone = calls[0]["lone"]
    assert lone["error"] is not None and lone["seconds"] < FAST_S, lone
    assert (
        "consolidate_state_dict() -- a collective: every rank of the group must call it"
        in lone["error"]
    )
    assert calls[1]["lone"]["error"] is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(SPARSE_MODES))
def test_sparse_gradients_are_densified(bundle: list[dict[str, Any]], mode: str) -> None:
    _intact(bundle, _sparse)
    for out in bundle:
        sparse, dense = out[f"sparse/{mode}/True"], out[f"sparse/{mode}/False"]
        assert isinstance(sparse, torch.Tensor), sparse
        assert torch.equal(sparse, dense)
    assert torch.equal(bundle[0][f"sparse/{mode}/True"], bundle[1][f"sparse/{mode}/True"])


@pytest.mark.timeout(300)
def test_a_backward_that_reaches_no_sentinel_is_no_false_alarm(
    bundle: list[dict[str, Any]],
) -> None:
    _intact(bundle, _unseen_pass)
    for out in bundle:
        plain, counted = out["unseen/overlap=False"], out["unseen/overlap=True"]
        assert isinstance(plain, torch.Tensor), plain
        assert torch.allclose(plain, counted, rtol=0, atol=1e-6)
        # ... while a real extra step() is still an error on every rank
        assert "backward passes since the last step() differ" in out["unseen/extra_step"]
        assert out["unseen/extra_step/paired"]
    assert torch.equal(bundle[0]["unseen/overlap=False"], bundle[1]["unseen/overlap=False"])


# ---------------------------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------------------------
def _one_shard(opt: torch.optim.Optimizer, **kwargs: Any) -> CrossShardOptimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "behaving as one shard"
        return CrossShardOptimizer(opt, **kwargs)


@pytest.mark.parametrize("views", [False, True])
def test_synchronize_and_max_grad_norm_on_one_shard_clip_like_torch(views: bool) -> None:
    flats = []
    for how in ("torch", "synchronize", "max_grad_norm"):
        model = _mlp()
        if how == "torch":
            opt: torch.optim.Optimizer = _sgd(model.parameters())
        else:
            clip = CLIP if how == "max_grad_norm" else None
            opt = _one_shard(
                _sgd(model.parameters()), gradient_as_bucket_view=views, max_grad_norm=clip
            )
        for it in range(STEPS):
            opt.zero_grad()
            x, y = _batch(0, it)
            F.mse_loss(model(x), y).backward()
            if how != "max_grad_norm":
                if how == "synchronize":
                    opt.synchronize()  # type: ignore[attr-defined]
                nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        flats.append(_flat(model))
    assert torch.equal(flats[0], flats[1]) and torch.equal(flats[0], flats[2])


def test_max_grad_norm_on_the_tf_path_leaves_the_callers_gradients_alone() -> None:
    model = _mlp()
    opt = _one_shard(_sgd(model.parameters()), max_grad_norm=CLIP)
    x, y = _batch(0, 0)
    pairs = opt.compute_gradients(F.mse_loss(model(x), y))
    before = [g.clone() for g, _ in pairs]
    opt.apply_gradients(pairs)
    assert all(torch.equal(g, b) for (g, _), b in zip(pairs, before))
    reference = _mlp()
    ref_opt = _sgd(reference.parameters())
    F.mse_loss(reference(x), y).backward()
    nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
    ref_opt.step()
    assert torch.equal(_flat(model), _flat(reference))


def test_wrong_shaped_gradient_is_named_on_one_shard() -> None:
    model = _mlp()
    opt = _one_shard(_sgd(model.parameters()), backward_passes_per_step=2)
    x, y = _batch(0, 0)
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
    model[2].weight.grad.data = torch.zeros(5)
    with pytest.raises(ValueError, match=r"trainable parameter 2 .* has shape \(5,\), but the "):
        opt.step()
