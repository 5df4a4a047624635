"""Per-rank optimizer checkpoints through torch.distributed.checkpoint, resharded on load.

Two gloo ranks train with ``shard_optimizer_state=True`` and save per rank (``save_sharded``,
and nested next to the model with ``dcp.save``); each rank's file holds only its half of the
state. One and three ranks then load them (``load_sharded``): the gathered state equals the
state the two ranks held, bitwise, and training goes on exactly as after loading the gathered
``state_dict()``. An unsharded run's per-rank checkpoint loads into a sharded optimizer too, and
a checkpoint of something else is refused before anything changes: another format, another
optimizer type (SGD into Adam), other parameter shapes of the same sizes (``Linear(6, 4)`` into
``Linear(4, 6)``), other hyperparameter or state keys. A missing or truncated file, or a
directory that cannot be written, is a ``CheckpointError`` (an ``Exception``, not DCP's
``BaseException``) naming it, on every rank. Real files in ``tmp_path``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from distoptim import CrossShardOptimizer
from distoptim.launch import spawn
from distoptim.sync.sharded_checkpoint import CheckpointError

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*behaving as one shard", "ignore:torch.distributed is disabled"
)
STEPS = 3
ROWS = 12  # samples per step, split between the ranks of each run (1, 2 or 3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 3)
    )


def _optimizer(model: nn.Module, shard: bool) -> CrossShardOptimizer:
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    groups = [{"params": first}, {"params": rest, "lr": 0.01}]
    return CrossShardOptimizer(
        torch.optim.Adam(groups, lr=0.05, amsgrad=True),
        shard_optimizer_state=shard,
        bucket_cap_mb=0.02,  # several buckets: parameters split between ranks
    )


def _steps(opt: CrossShardOptimizer, model: nn.Module, first: int, count: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g))
            for _ in range(first + count)]  # fmt: skip
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    for x, y in data[first:]:
        opt.zero_grad()
        F.mse_loss(model(x[rows].double()), y[rows].double()).backward()
        opt.step()


def _full(opt: CrossShardOptimizer) -> dict[str, Any]:
    """The gathered, unsharded state dict, on every rank."""
    opt.consolidate_state_dict(to=None)
    return opt.state_dict()


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out = {}
    for shard in (True, False):
        model = _model().double()
        opt = _optimizer(model, shard)
        _steps(opt, model, 0, STEPS)
        name = "sharded" if shard else "unsharded"
        opt.save_sharded(Path(root) / name)
        full = _full(opt)
        if rank == 0:
            torch.save({"full": full, "model": model.state_dict()}, Path(root) / f"{name}.pt")
        if shard:
            dcp.save(
                {"model": model.state_dict(), "optim": opt.sharded_state_dict()},
                checkpoint_id=Path(root) / "nested",
            )
            out["state_bytes"] = sum(
                v.numel() * v.element_size()
                for s in full["state"].values()
                for v in s.values()
                if v.dim() > 0
            )
        opt.remove_hooks()
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _load(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for source, prefix in (("sharded", ""), ("unsharded", ""), ("nested", "optim")):
        saved = torch.load(
            Path(root) / f"{'sharded' if source == 'nested' else source}.pt", weights_only=False
        )
        runs = {}
        for how in ("per_rank", "gathered"):
            model = _model().double()
            opt = _optimizer(model, shard=True)
            if source == "nested" and how == "per_rank":
                sd = {"model": model.state_dict()}
                dcp.load(sd, checkpoint_id=Path(root) / "nested")
                model.load_state_dict(sd["model"])
            else:
                model.load_state_dict(saved["model"])
            if how == "per_rank":
                opt.load_sharded(Path(root) / source, prefix=prefix)
                out[f"{source}/loaded_equal"] = _same(_full(opt), saved["full"])
            else:
                opt.load_state_dict(saved["full"])
            _steps(opt, model, STEPS, 2)
            runs[how] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                         _full(opt))  # fmt: skip
            opt.remove_hooks()
        out[f"{source}/continued_equal"] = _same(runs["per_rank"], runs["gathered"])
    # a checkpoint of something else is refused before the optimizer changes
    model = _model().double()
    opt = _optimizer(model, shard=True)
    dcp.save({"weights": model.state_dict()}, checkpoint_id=Path(root) / f"other{world}")
    try:
        opt.load_sharded(Path(root) / f"other{world}")
        out["other"] = "loaded"
    except ValueError as exc:
        out["other"] = str(exc)
    return out


def _state_bytes_by_file(path: Path) -> dict[str, int]:
    """Bytes of per-element optimizer state (1-D chunks under ``state.``) in each file."""
    md = dcp.FileSystemReader(path).read_metadata()
    out: dict[str, int] = {}
    for index, info in md.storage_data.items():
        entry = md.state_dict_metadata[index.fqn]
        if not index.fqn.startswith("state.") or len(getattr(entry, "size", ())) != 1:
            continue
        (chunk,) = [c for c in entry.chunks if c.offsets == index.offset]
        nbytes = chunk.sizes[0] * torch.empty((), dtype=entry.properties.dtype).element_size()
        out[info.relative_path] = out.get(info.relative_path, 0) + nbytes
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_per_rank_checkpoints_reshard_from_two_ranks_to_one_and_three(tmp_path: Path) -> None:
    (saved, _) = spawn(_save, 2, args=(str(tmp_path),), timeout=180)
    state_bytes = saved["state_bytes"]
    files = sorted((tmp_path / "sharded").glob("*.distcp"))
    assert len(files) == 2  # one per rank
    written = _state_bytes_by_file(tmp_path / "sharded")
    assert sorted(written) == [f.name for f in files]
    for size in written.values():  # each rank wrote its half of the moments
        assert 0.4 * state_bytes < size < 0.6 * state_bytes, (written, state_bytes)
    for world in (1, 3):
        for out in spawn(_load, world, args=(str(tmp_path),), timeout=180):
            for source in ("sharded", "unsharded", "nested"):
                assert out[f"{source}/continued_equal"], (world, source)
            for source in ("sharded", "unsharded"):
                assert out[f"{source}/loaded_equal"], (world, source)
            assert "not a per-rank CrossShardOptimizer checkpoint" in out["other"]


# ---- a checkpoint that does not fit is refused before anything changes (one process) --------
def _trained(model: nn.Module, inner: torch.optim.Optimizer, shard: bool) -> CrossShardOptimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "behaving as one shard", DCP without a process group
        opt = CrossShardOptimizer(inner, shard_optimizer_state=shard)
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            x = torch.randn(5, model.in_features, generator=g)
            y = torch.randn(5, model.out_features, generator=g)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return opt


def _refused(opt: CrossShardOptimizer, path: Path) -> str:
    """``load_sharded``'s ValueError, after checking that nothing changed."""
    before = (
        [dict(g) for g in opt.param_groups],
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in _state_of(opt).items()},
        opt.iterations,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as info:
            opt.load_sharded(path)
    assert [dict(g) for g in opt.param_groups] == before[0]
    assert _same(_state_of(opt), before[1]) and opt.iterations == before[2]
    return str(info.value)


def _state_of(opt: CrossShardOptimizer) -> dict[str, Any]:
    """Every state entry, flat (one process: ``state_dict()`` is local)."""
    sd = opt.state_dict()["state"]
    return {f"{i}/{k}": v for i, s in sd.items() for k, v in s.items()}


@pytest.mark.parametrize("shard", [False, True], ids=["into_unsharded", "into_sharded"])
@pytest.mark.parametrize("saved_shard", [False, True], ids=["from_unsharded", "from_sharded"])
def test_a_checkpoint_of_another_optimizer_type_is_refused(
    tmp_path: Path, shard: bool, saved_shard: bool
) -> None:
    model = nn.Linear(6, 4)
    sgd = _trained(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), saved_shard)
    sgd.save_sharded(tmp_path / "sgd")
    adam_model = nn.Linear(6, 4)
    for stepped in (False, True):  # a fresh Adam, and one that holds state already
        if stepped:
            adam = _trained(adam_model, torch.optim.Adam(adam_model.parameters()), shard)
        else:
            adam = CrossShardOptimizer(
                torch.optim.Adam(adam_model.parameters()), shard_optimizer_state=shard
            )
        message = _refused(adam, tmp_path / "sgd")
        assert "checkpoint of a torch.optim.sgd.SGD" in message
        assert "wraps a torch.optim.adam.Adam" in message
        adam.zero_grad()  # and it still trains (before: KeyError 'betas' here)
        F.mse_loss(adam_model(torch.randn(5, 6)), torch.randn(5, 4)).backward()
        adam.step()


@pytest.mark.parametrize("shard", [False, True], ids=["unsharded", "sharded"])
def test_a_checkpoint_of_other_shapes_with_the_same_sizes_is_refused(
    tmp_path: Path, shard: bool
) -> None:
    model = nn.Linear(6, 4)
    _trained(model, torch.optim.Adam(model.parameters()), shard).save_sharded(tmp_path / "a")
    other = nn.Linear(4, 6)  # the weights have the same number of elements
    opt = _trained(other, torch.optim.Adam(other.parameters()), shard)
    message = _refused(opt, tmp_path / "a")
    assert "parameter 0: saved (4, 6), this optimizer's (6, 4)" in message
    assert "parameter 1: saved (4,), this optimizer's (6,)" in message
    # the same numel for every parameter: Linear(6, 4) without bias into Linear(4, 6)
    lone, turned = nn.Linear(6, 4, bias=False), nn.Linear(4, 6, bias=False)
    opt = _trained(lone, torch.optim.Adam(lone.parameters()), shard)
    opt.save_sharded(tmp_path / "b")
    fresh = CrossShardOptimizer(torch.optim.Adam(turned.parameters()), shard_optimizer_state=shard)
    assert "parameter 0: saved (4, 6), this optimizer's (6, 4)" in _refused(fresh, tmp_path / "b")


@pytest.mark.parametrize("shard", [False, True], ids=["unsharded", "sharded"])
def test_other_hyperparameter_or_state_keys_are_refused(tmp_path: Path, shard: bool) -> None:
    model = nn.Linear(6, 4)
    tagged = [{"params": list(model.parameters()), "tag": "head"}]  # a key of the user's own
    _trained(model, torch.optim.Adam(tagged), shard).save_sharded(tmp_path / "tagged")
    plain = CrossShardOptimizer(torch.optim.Adam(model.parameters()), shard_optimizer_state=shard)
    message = _refused(plain, tmp_path / "tagged")
    assert "param group 0 has the hyperparameters" in message
    assert "missing: [], extra: ['tag']" in message
    # the same type and keys, other state: amsgrad keeps max_exp_avg_sq
    _trained(model, torch.optim.Adam(model.parameters(), amsgrad=True), shard).save_sharded(
        tmp_path / "amsgrad"
    )
    stepped = _trained(model, torch.optim.Adam(model.parameters()), shard)
    message = _refused(stepped, tmp_path / "amsgrad")
    assert "parameter 0 (shape (4, 6)) has the saved state keys" in message
    assert "'max_exp_avg_sq'" in message
    # what fits loads (a fresh optimizer takes the saved hyperparameters and state)
    fresh = CrossShardOptimizer(torch.optim.Adam(model.parameters()), shard_optimizer_state=shard)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh.load_sharded(tmp_path / "amsgrad")
    assert fresh.param_groups[0]["amsgrad"] and fresh.iterations == 2


# ---- DCP's errors (BaseException) arrive as an Exception naming the checkpoint and file ------
@pytest.mark.parametrize("damage", ["truncated", "missing", "no_checkpoint"])
def test_a_damaged_checkpoint_is_an_exception_naming_the_file(tmp_path: Path, damage: str) -> None:
    model = nn.Linear(6, 4)
    _trained(model, torch.optim.Adam(model.parameters()), True).save_sharded(tmp_path / "c")
    (data,) = (tmp_path / "c").glob("*.distcp")
    half = data.stat().st_size // 2
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:half])
    elif damage == "missing":
        data.unlink()
    else:
        (tmp_path / "c" / ".metadata").unlink()
    opt = _trained(model, torch.optim.Adam(model.parameters()), True)
    before = _state_of(opt)
    with pytest.raises(Exception) as info:  # the point: an Exception at all
        opt.load_sharded(tmp_path / "c")
    assert isinstance(info.value, CheckpointError), type(info.value).__mro__
    message = str(info.value)
    assert f"could not load the per-rank optimizer checkpoint {str(tmp_path / 'c')!r}" in message
    expected = {
        "truncated": f"file {data} has {half} bytes, its metadata needs at least",
        "missing": f"file {data} is missing",
        "no_checkpoint": f"{tmp_path / 'c' / '.metadata'} does not exist",
    }[damage]
    assert expected in message
    assert _same(_state_of(opt), before)  # nothing changed


def test_a_checkpoint_that_cannot_be_written_is_an_exception_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    model = nn.Linear(6, 4)
    opt = _trained(model, torch.optim.Adam(model.parameters()), True)
    with pytest.raises(CheckpointError) as info:
        opt.save_sharded(tmp_path / "file" / "c")
    assert f"could not save the per-rank optimizer checkpoint {str(tmp_path / 'file' / 'c')!r}" in (
        str(info.value)
    )


def _small(rank: int) -> tuple[nn.Module, CrossShardOptimizer]:
    model = nn.Linear(6, 64).double()
    opt = CrossShardOptimizer(torch.optim.Adam(model.parameters()), shard_optimizer_state=True)
    g = torch.Generator().manual_seed(rank)
    opt.zero_grad()
    model(torch.randn(4, 6, generator=g).double()).square().mean().backward()
    opt.step()
    return model, opt


def _save_small(rank: int, world: int, root: str) -> None:
    _small(rank)[1].save_sharded(Path(root) / "c")


def _load_damaged(rank: int, world: int, root: str) -> dict[str, Any]:
    _, opt = _small(rank)
    try:
        opt.load_sharded(Path(root) / "c")
    except Exception as exc:  # CheckpointError expected; anything else recorded
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_truncated_shard_file_is_a_checkpoint_error_on_every_rank(tmp_path: Path) -> None:
    spawn(_save_small, 2, args=(str(tmp_path),), timeout=120)
    files = sorted((tmp_path / "c").glob("*.distcp"))
    assert len(files) == 2
    damaged = files[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    for rank, out in enumerate(spawn(_load_damaged, 2, args=(str(tmp_path),), timeout=120)):
        assert out["error"] == "CheckpointError", (rank, out)
        assert f"file {damaged} has 100 bytes, its metadata needs at least" in out["message"]


@pytest.mark.parametrize("depth", [1, 2], ids=["mesh_sgd", "wrapped_mesh_sgd"])
def test_the_wrapped_chains_step_counts_round_trip(tmp_path: Path, depth: int) -> None:
    """A Keras-style inner (distoptim.dtensor.SGD) keeps its own step count, which its
    schedule reads; a per-rank checkpoint keeps it however deep the wrapper chain (it was lost:
    saved (2, 2), loaded (2, 0))."""
    from distoptim.dtensor import SGD
    from distoptim.protocol import WrappedOptimizer

    def inner(model: nn.Module) -> torch.optim.Optimizer:
        sgd = SGD(model.parameters(), learning_rate=0.1, momentum=0.9)
        return sgd if depth == 1 else WrappedOptimizer(sgd)

    def counts(opt: CrossShardOptimizer) -> list[int]:
        out, o = [opt.iterations], opt.wrapped
        while o is not None:
            out.append(o.iterations)
            o = getattr(o, "wrapped", None)
        return out

    model = nn.Linear(6, 4)
    opt = _trained(model, inner(model), shard=False)
    opt.wrapped.iterations += 3  # every level its own count
    saved = counts(opt)
    assert len(saved) == depth + 1 and len(set(saved)) == 2
    opt.save_sharded(tmp_path / "c")
    fresh_model = nn.Linear(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = CrossShardOptimizer(inner(fresh_model))
        fresh.load_sharded(tmp_path / "c")
    assert counts(fresh) == saved
