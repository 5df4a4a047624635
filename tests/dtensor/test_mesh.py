"""distoptim.dtensor.SGD and clipping on DTensors, 2 gloo ranks, against one process.

All 2-rank checks run in ONE spawn (process start-up dominates): the worker below asserts
each property and returns a summary the parent checks again. Covered: Shard(0)/Shard(1)/
Replicate parameters equal to the single-process optimizer (momentum, Nesterov, global-norm
clipping, EMA); Replicate/Partial/Shard gradients redistributed to the parameter's placements;
mesh-correct norms (each logical element once) on one mesh and across two meshes; slots with
the parameter's layout; Keras-style minimize on DTensors; mesh errors with nothing mutated;
config round trip with a mesh; torch.distributed.checkpoint save/load with an identical next
step; gradients only read; what ``layout.local_shard`` relies on in torch's DTensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from distoptim.dtensor import SGD, EMAOption, GradientsClipOption
from distoptim.dtensor.clip import squared_norms
from distoptim.dtensor.layout import layout_of, local_shard
from distoptim.launch import spawn

_SHAPES = [(6, 3), (5,), (4, 4), (3, 2)]


def _data(steps: int):
    gen = torch.Generator().manual_seed(7)
    w0 = [torch.randn(s, generator=gen) for s in _SHAPES]
    grads = [[torch.randn(s, generator=gen) * (t + 1) for s in _SHAPES] for t in range(steps)]
    return w0, grads


def _as_grad(full: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    """``full`` as a DTensor gradient with ``placements``. Along a Partial mesh dimension of
    size n the rank at coordinate c holds the share (c+1) / (n(n+1)/2): unequal, summing to 1."""
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = distribute_tensor(full, mesh, plain).to_local()
    coord = mesh.get_coordinate()
    for dim, p in enumerate(placements):
        if isinstance(p, Partial):
            n = mesh.size(dim)
            local = local * (coord[dim] + 1) / (n * (n + 1) / 2)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def _kwargs():
    return {
        "learning_rate": 0.05,
        "momentum": 0.9,
        "nesterov": True,
        "gradients_clip_option": GradientsClipOption(global_clipnorm=4.0, clipvalue=3.0),
        "ema_option": EMAOption(True, 0.9, 2),
    }


def _check_against_single_process(rank, world, mesh, mesh2):
    steps = 4
    w0, grads = _data(steps)
    # param placements; gradient placements differ on purpose for three of them
    p_pl = [[Shard(0)], [Replicate()], [Shard(1)], [Shard(0), Replicate()]]
    g_pl = [[Replicate()], [Partial()], [Shard(0)], [Partial(), Shard(1)]]
    meshes = [mesh, mesh, mesh, mesh2]  # two meshes: the global norm spans both
    ps = [distribute_tensor(w.clone(), m, pl) for w, m, pl in zip(w0, meshes, p_pl)]
    opt = SGD(ps, **_kwargs())
    for t in range(steps):
        for p, g, m, gp in zip(ps, grads[t], meshes, g_pl):
            p.grad = _as_grad(g, m, gp)
        kept = [p.grad.to_local().clone() for p in ps]
        opt.step()
        assert all(torch.equal(p.grad.to_local(), k) for p, k in zip(ps, kept))  # read only
    ref = [w.clone().requires_grad_() for w in w0]
    ro = SGD(ref, **_kwargs())
    for t in range(steps):
        for r, g in zip(ref, grads[t]):
            r.grad = g.clone()
        ro.step()
    diffs = []
    for p, r in zip(ps, ref):
        diffs.append((p.full_tensor() - r.detach()).abs().max().item())
        for name in ("m", "average"):
            s = opt.get_slot(p, name)
            assert isinstance(s, DTensor), name
            assert s.device_mesh == p.device_mesh and s.placements == p.placements
            torch.testing.assert_close(s.full_tensor(), ro.get_slot(r, name))
    assert max(diffs) < 1e-5, diffs
    # the global norm really was active (a no-op clip would prove nothing)
    gn = sum(float(g.square().sum()) for g in grads[0]) ** 0.5
    assert gn > 4.0
    return max(diffs)


def _check_norms(rank, world, mesh, mesh2):
    gen = torch.Generator().manual_seed(11)
    fulls = [
        torch.randn(7, 3, generator=gen),
        torch.randn(5, generator=gen),
        torch.randn(2, 6, generator=gen),
    ]
    layouts = [(mesh, (Shard(0),)), (mesh, (Replicate(),)), (mesh2, (Replicate(), Shard(1)))]
    dts = [distribute_tensor(f, m, list(pl)) for f, (m, pl) in zip(fulls, layouts)]
    got = squared_norms([d.to_local() for d in dts], layouts)
    want = torch.stack([f.square().sum() for f in fulls])
    torch.testing.assert_close(got, want)  # uneven Shard(0) of 7 rows included
    got1 = squared_norms([dts[0].to_local(), dts[1].to_local()], layouts[:2])  # one mesh
    torch.testing.assert_close(got1, want[:2])
    return got.tolist()


def _check_errors(rank, world, mesh, mesh2):
    p = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    q = distribute_tensor(torch.ones(4, 2), mesh2, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match="mesh"):
        SGD([q], mesh=mesh)
    with pytest.raises(ValueError, match="plain tensor"):
        SGD([torch.ones(2, requires_grad=True)], mesh=mesh)
    with pytest.raises(ValueError, match="Partial"):
        SGD([DTensor.from_local(torch.ones(2), mesh, [Partial()])])
    opt = SGD([p], lr=0.1, momentum=0.9, mesh=mesh)
    before = (p.full_tensor().clone(), opt.get_slot(p, "m").full_tensor().clone())
    with pytest.raises(ValueError, match="mesh"):
        opt.apply_gradients([(q.detach().clone(), q)])  # a variable on another mesh
    with pytest.raises(ValueError, match="mesh"):
        opt.build([q])
    with pytest.raises(TypeError, match="DTensor"):
        opt.apply_gradients([(torch.ones(4, 2), p)])
    with pytest.raises(ValueError, match="mesh"):
        opt.apply_gradients(
            [(distribute_tensor(torch.ones(4, 2), mesh2, [Shard(0), Replicate()]), p)]
        )
    with pytest.raises(ValueError, match="shape"):
        opt.apply_gradients([(distribute_tensor(torch.ones(2, 4), mesh, [Shard(0)]), p)])
    assert torch.equal(p.full_tensor(), before[0]) and opt.iterations == 0
    assert torch.equal(opt.get_slot(p, "m").full_tensor(), before[1])
    assert len(opt._all_params()) == 1
    # a DTensor gradient set on a plain parameter after steps that kept a plan: still refused
    w = torch.zeros(4, 2, requires_grad=True)
    plain = SGD([w], lr=0.1, momentum=0.9)
    for _ in range(2):
        w.grad = torch.ones(4, 2)
        plain.step()
    assert plain._plan is not None
    w.grad = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
    with pytest.raises(TypeError, match="plain tensor"):
        plain.step()
    assert plain.iterations == 2 and torch.equal(w, torch.full((4, 2), -0.29))
    # layout-preserving variables
    r = opt.add_variable_from_reference(p, "extra", initial_value=torch.arange(8.0).reshape(4, 2))
    assert r.placements == p.placements and torch.equal(
        r.full_tensor(), torch.arange(8.0).reshape(4, 2)
    )
    v = opt.add_variable((3,), initializer=2.0)
    assert isinstance(v, DTensor) and v.placements == (Replicate(),)
    # config with a mesh round-trips (the mesh is rebuilt from its ranks)
    cfg = opt.get_config()
    again = SGD.from_config(cfg)
    assert again.get_config() == cfg and again._mesh == mesh
    return True


def _check_keras_style(rank, world, mesh):
    var = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    var.requires_grad_(True)
    opt = SGD(learning_rate=0.1, momentum=0.9, mesh=mesh)
    for _ in range(2):
        opt.minimize(lambda: (var * var).sum() / 2.0, [var])
    # per element: 1 -> 0.9 -> 0.72 (the seed page's 0.1 then 0.18)
    torch.testing.assert_close(var.full_tensor(), torch.full((4,), 0.72))
    assert opt.get_slot(var, "m").placements == (Shard(0),)


def _check_checkpoint(rank, world, mesh, ckpt_dir):
    def make():
        w0, _ = _data(0)
        ps = [
            distribute_tensor(w0[0].clone(), mesh, [Shard(0)]),
            distribute_tensor(w0[1].clone(), mesh, [Replicate()]),
        ]
        return ps, SGD(ps, **_kwargs())

    def set_grads(ps, seed):
        gen = torch.Generator().manual_seed(seed)
        for p in ps:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, p.placements)

    ps, opt = make()
    for t in range(3):
        set_grads(ps, t)
        opt.step()
    dcp.save({"model": dict(enumerate(ps)), "optim": opt.state_dict()}, checkpoint_id=ckpt_dir)
    set_grads(ps, 99)
    opt.step()
    want = [p.full_tensor() for p in ps]
    ps2, opt2 = make()  # fresh: different weights, zero slots, iterations 0
    sd = {"model": dict(enumerate(ps2)), "optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    opt2.load_state_dict(sd["optim"])
    assert opt2.iterations == 3
    assert opt2.get_slot(ps2[0], "m").placements == (Shard(0),)
    set_grads(ps2, 99)
    opt2.step()
    for a, b in zip(want, ps2):
        assert torch.equal(a, b.full_tensor())
    return opt2.iterations


def _check_layout(rank, world, mesh):
    """What local_shard relies on: a DTensor's local shard is its storage (for an
    nn.Parameter too), and a redistribute's pending collective is completed."""
    d = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    with torch.no_grad():
        assert local_shard(d) is d.to_local()
        local_shard(d).add_(1.0)
    torch.testing.assert_close(d.full_tensor(), torch.arange(8.0) + 1)
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    with torch.no_grad():
        assert local_shard(p).data_ptr() == p.to_local().data_ptr()
        local_shard(p).fill_(3.0)
    assert torch.equal(p.full_tensor(), torch.full((4, 2), 3.0))
    r = d.redistribute(mesh, [Replicate()])
    loc = local_shard(r)
    assert type(loc) is torch.Tensor and torch.equal(loc, torch.arange(8.0) + 1)
    assert layout_of(d) == (mesh, (Shard(0),)) and layout_of(loc) is None


def _mesh_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    # a second mesh, 2-D: dim 0 of size 1, dim 1 spans the ranks (Replicate there is real)
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    out = {}
    _check_layout(rank, world, mesh)
    out["max_diff"] = _check_against_single_process(rank, world, mesh, mesh2)
    out["norms"] = _check_norms(rank, world, mesh, mesh2)
    out["errors"] = _check_errors(rank, world, mesh, mesh2)
    _check_keras_style(rank, world, mesh)
    out["iterations"] = _check_checkpoint(rank, world, mesh, ckpt_dir)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_rank_dtensor_sgd(tmp_path):
    results = spawn(_mesh_worker, 2, args=(str(tmp_path / "ckpt"),), timeout=200)
    assert len(results) == 2
    for r in results:
        assert r["max_diff"] < 1e-5 and r["errors"] and r["iterations"] == 4
    assert results[0]["norms"] == results[1]["norms"]  # every rank sees the same norms
