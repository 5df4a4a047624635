"""Per-rank optimizer checkpoints through torch.distributed.checkpoint, resharded on load.

Two gloo ranks train with ``shard_optimizer_state=True`` and save per rank (``save_sharded``,
and nested next to the model with ``dcp.save``); each rank's file holds only its half of the
state. One and three ranks then load them (``load_sharded``): the gathered state equals the
state the two ranks held, bitwise, and training goes on exactly as after loading the gathered
``state_dict()``. An unsharded run's per-rank checkpoint loads into a sharded optimizer too, and
a checkpoint of something else is refused before anything changes. Real files in ``tmp_path``.
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


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out = {}
    for shard in (True, False):
        model = _model().double()
        opt = _optimizer(model, shard)
        _steps(opt, model, 0, STEPS)
        name = "sharded" if shard else "unsharded"
        opt.save_sharded(Path(root) / name)
        full = opt.state_dict()  # gathered (every rank calls it)
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
                out[f"{source}/loaded_equal"] = _same(opt.state_dict(), saved["full"])
            else:
                opt.load_state_dict(saved["full"])
            _steps(opt, model, STEPS, 2)
            runs[how] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                         opt.state_dict())  # fmt: skip
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
