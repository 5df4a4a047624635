"""distoptim.agn on real local clusters, on both transports: exact TF-contrib semantics.

A cluster start is slow, so each cluster run checks many things: one module-scoped run per
cluster shape and transport, several tests reading its result. Worker functions return what they
saw; the tests compare it with a plain-torch reference simulation of the documented math.
"""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest
import torch

import distoptim
from distoptim.agn import ParameterServerError, spawn
from distoptim.agn.server import CHUNK_ENV
from distoptim.agn.transport.messages import Commit, Ping
from distoptim.launch import RankFailedError

pytestmark = pytest.mark.timeout(420)  # above the cluster bound: a hang is the bound's error

TRANSPORTS = ["p2p", "rpc"]

LR = 0.1
MOMENTUM = 0.5


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
def _model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(2, 3)  # two parameters: weight (3, 2) and bias (3,)


def _batch(task: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * task + step)
    return torch.randn(5, 2, generator=g), torch.randn(5, 3, generator=g)


def _init(opt, ctx) -> None:
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()


def _train(opt, model, ctx, steps, *, record=True, nan_at=None):
    """Run ``steps`` worker steps; record grads, local params, center and global_step."""
    rec = {"grads": [], "local": [], "center": [], "global_step": [], "warned": []}
    params = list(model.parameters())
    for k in range(steps):
        x, y = _batch(ctx.task_index, k)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        if nan_at == k:
            params[0].grad[0, 0] = float("nan")
        rec["grads"].append([p.grad.clone() for p in params])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        rec["warned"].append([str(w.message) for w in caught if w.category is RuntimeWarning])
        if record:
            rec["local"].append([p.detach().clone() for p in params])
            rec["center"].append(opt.center_variables())
            rec["global_step"].append(opt.global_step)
    return rec


def _single_worker(ctx, out_dir: str) -> dict:
    """Worker 0 alone on its tables, two shards: every algorithm's math, NaN refusal, placement.

    (The cluster has two workers -- worker 1 takes part in ``_two_workers`` only -- so the
    optimizers are built for ``ctx.num_worker``; nothing else of their math depends on it.)
    """
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)  # noqa: E731
    n = ctx.num_worker
    out = {"num_ps": ctx.num_ps}

    m = _model(0)
    out["agn4_c0"] = [p.detach().clone() for p in m.parameters()]
    opt = distoptim.AGNOptimizer(sgd(m), n, communication_period=4, name="agn4")
    _init(opt, ctx)
    out["agn4"] = _train(opt, m, ctx, 8)
    out["agn4_local_step"] = opt.local_step

    m = _model(1)
    out["delta_c0"] = [p.detach().clone() for p in m.parameters()]
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(m.parameters(), lr=LR),
        n,
        communication_period=2,
        update_rule="delta",
        name="delta",
    )
    _init(opt, ctx)
    out["delta"] = _train(opt, m, ctx, 4)

    m = _model(2)
    out["downpour_c0"] = [p.detach().clone() for p in m.parameters()]
    opt = distoptim.DownpourOptimizer(torch.optim.SGD(m.parameters(), lr=LR), n, None, 2)
    _init(opt, ctx)
    out["downpour"] = _train(opt, m, ctx, 4)

    m = _model(3)
    out["easgd_c0"] = [p.detach().clone() for p in m.parameters()]
    opt = distoptim.ElasticAverageOptimizer(torch.optim.SGD(m.parameters(), lr=LR), n, None, 2)
    out["easgd_alpha"] = opt.moving_rate
    _init(opt, ctx)
    out["easgd"] = _train(opt, m, ctx, 4)

    # the TF path: minimize(loss) and apply_gradients go through the same step
    m = _model(5)
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(m.parameters(), lr=LR), n, communication_period=2, name="tf"
    )
    _init(opt, ctx)
    x, y = _batch(0, 0)
    gs = torch.tensor(0)
    opt.minimize(lambda: (m(x) - y).pow(2).mean(), global_step=gs)
    pairs = opt.compute_gradients(lambda: (m(x) - y).pow(2).mean())
    out["tf_iterations"] = opt.apply_gradients(pairs, global_step=gs)
    out["tf"] = {
        "global_step": opt.global_step,
        "tf_global_step": int(gs),
        "local": [p.detach().clone() for p in m.parameters()],
        "center": opt.center_variables(),
    }

    # NaN in a commit: refused by the worker's cross-shard check (two shards)...
    m = _model(4)
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(m.parameters(), lr=LR), n, communication_period=1, name="nan"
    )
    _init(opt, ctx)
    out["nan"] = _train(opt, m, ctx, 3, nan_at=1)
    # ...and by a shard on its own, for a client that sends one anyway
    key = next(iter(opt._conn.links[1].layout.sizes))
    bad = {key: torch.full((3,), float("inf"))}
    out["nan_direct"] = ctx.request(1, Commit("nan", 0, 0, bad))
    out["nan_center_after"] = opt.center_variables()
    return out


def _resume_worker(ctx, out_dir: str) -> dict:
    """Restarted cluster: the chief's seed is ignored, training continues; then a PS dies."""
    m = _model(99)  # different from the first run: the checkpoint must win
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM),
        1,
        communication_period=4,
        name="agn4",
    )
    _init(opt, ctx)
    out = {"after_init": [p.detach().clone() for p in m.parameters()]}
    out["global_step_after_init"] = opt.global_step
    out["run"] = _train(opt, m, ctx, 4)
    torch.save(out, os.path.join(out_dir, "resume.pt"))
    # a dead parameter server: a clear error, not a hang
    os.kill(ctx.request(1, Ping()).pid, signal.SIGKILL)
    try:
        for _ in range(4):
            _train(opt, m, ctx, 4, record=False)
    except ParameterServerError as exc:
        out["dead_ps_error"] = str(exc)
    torch.save(out, os.path.join(out_dir, "resume.pt"))
    return out


def _wait_for_file(path: str, seconds: float) -> None:
    """A bounded wait for a file another process writes."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds}s")
        time.sleep(0.01)


def _two_workers(ctx, out_dir: str) -> dict:
    """λ=1 with two workers, chief-seeded init, then worker 1 is SIGKILLed mid-run."""
    m = _model(10 + ctx.task_index)  # each worker starts from different values
    out = {"before_init": [p.detach().clone() for p in m.parameters()]}
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(m.parameters(), lr=LR),
        ctx.num_worker,
        communication_period=1,
        name="lam1",
    )
    _init(opt, ctx)
    out["after_init"] = [p.detach().clone() for p in m.parameters()]
    # the chief starts committing once worker 1 took the seed (p2p has no start-up barrier)
    marker = os.path.join(out_dir, "worker1_initialized")
    if ctx.task_index == 1:
        open(marker, "w").close()
    else:
        _wait_for_file(marker, 60)
    out["lam1"] = _train(opt, m, ctx, 6, record=False)
    torch.save(out, os.path.join(out_dir, f"worker{ctx.task_index}.pt"))

    m = _model(20)
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(m.parameters(), lr=LR),
        ctx.num_worker,
        communication_period=1,
        name="kill",
    )
    _init(opt, ctx)
    if ctx.task_index == 1:
        _train(opt, m, ctx, 2, record=False)
        os.kill(os.getpid(), signal.SIGKILL)
    _train(opt, m, ctx, 20, record=False)
    out["kill_global_step"] = opt.global_step
    return out


def _main_worker(ctx, out_dir: str) -> dict:
    """Both workers: the two-worker sections; then worker 0 alone: the single-worker ones."""
    out = _two_workers(ctx, out_dir)  # worker 1 dies in there
    out.update(_single_worker(ctx, out_dir))
    return out


# ---------------------------------------------------------------------------------------------
# reference simulations of the documented math (plain torch, one process)
# ---------------------------------------------------------------------------------------------
def _params(ts):
    return [torch.nn.Parameter(t.clone()) for t in ts]


def _set(dst, src):
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)


def _simulate(kind, c0, grads, lam, momentum=0.0, alpha=None, server_opt=None, center=None):
    """Per step: (local params, center, global_step) following the docstrings' math."""
    theta = _params(c0)
    center = _params(c0) if center is None else center
    local_opt = torch.optim.SGD(theta, lr=LR, momentum=momentum)
    if kind == "gradient" and server_opt is None:
        server_opt = torch.optim.SGD(center, lr=LR, momentum=momentum)
    acc = [torch.zeros_like(t) for t in c0]
    pulled = [c.detach().clone() for c in center]
    out = []
    version = 0
    for k, g in enumerate(grads, start=1):
        for p, gi, a in zip(theta, g, acc):
            p.grad = gi.clone()
            a += gi
        local_opt.step()
        if k % lam == 0:
            with torch.no_grad():
                if kind == "gradient":
                    for c, a in zip(center, acc):
                        c.grad = a / lam
                    server_opt.step()
                    _set(theta, center)
                elif kind in ("delta", "downpour"):
                    div = lam if kind == "delta" else 1
                    for c, t, p0 in zip(center, theta, pulled):
                        c += (t - p0) / div if div != 1 else t - p0
                    _set(theta, center)
                elif kind == "easgd":
                    for c, t in zip(center, theta):
                        d = (t - c) * alpha
                        t -= d
                        c += d
            acc = [torch.zeros_like(t) for t in c0]
            pulled = [c.detach().clone() for c in center]
            version += 1
        out.append(
            ([t.detach().clone() for t in theta], [c.detach().clone() for c in center], version)
        )
    return out, server_opt, center


def _close(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# cluster runs (module-scoped: each starts one cluster)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, transport):
    return tmp_path_factory.mktemp(f"agn_ckpt_{transport}")


@pytest.fixture(scope="module")
def run(ckpt_dir, tmp_path_factory, transport):
    """One cluster per transport: two workers, two shards (checkpointing every 2 commits).

    On p2p the shards apply commits in chunks of 8 bytes (2 float32 elements), so every
    commit is several chunks, the last one short: the exact-math tests below then check the
    chunked path (the server optimizer stepped piece by piece, each chunk guarded) and the
    replies read in place from the shards' memory against the whole-tensor reference (streamed
    commits give the same bits: tests/agn/test_transport.py)."""
    out_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        if transport == "p2p":
            mp.setenv(CHUNK_ENV, "8")
        result = spawn(
            _main_worker,
            2,
            num_ps=2,
            args=(str(out_dir),),
            timeout=360,  # generous: its ~15 CPU seconds take minutes at load 28 on 2 cores
            checkpoint_dir=ckpt_dir,
            checkpoint_every=2,
            transport=transport,
            rpc_timeout=30,
        )
    return result, out_dir


@pytest.fixture(scope="module")
def single(run):
    return run[0]


@pytest.fixture(scope="module")
def pair(run):
    return run


def test_agn_one_worker_lambda4_is_tf_contrib_exact(single):
    out = single.worker_results[0]
    rec = out["agn4"]
    ref, _, _ = _simulate("gradient", out["agn4_c0"], rec["grads"], 4, momentum=MOMENTUM)
    for k, (local, center, version) in enumerate(ref):
        _close(rec["local"][k], local)
        _close(rec["center"][k], center)
        assert rec["global_step"][k] == version
    # the local copy moves every step; the center only at the 4th; then local == center
    for k in range(1, 8):
        assert not torch.equal(rec["local"][k][0], rec["local"][k - 1][0])
    for k in (0, 1, 2):
        assert all(torch.equal(c, c0) for c, c0 in zip(rec["center"][k], out["agn4_c0"]))
    assert not torch.equal(rec["center"][3][0], out["agn4_c0"][0])
    for k in (3, 7):
        assert all(torch.equal(a, b) for a, b in zip(rec["local"][k], rec["center"][k]))
    assert rec["global_step"] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert out["agn4_local_step"] == 8
    per = single.stats.per_optimizer["agn4"]
    assert per["global_step"] == 2 and per["commits_per_worker"] == {0: 2}
    assert per["staleness_histogram"] == {0: 2}


def test_two_shards_each_hold_their_share(single):
    # round-robin by parameter: weight on ps:0, bias on ps:1, for every optimizer
    assert set(single.placement) == {"tf", "lam1", "kill"} | {
        "agn4",
        "delta",
        "DownpourOptimizer",
        "ElasticAverageOptimizer",
        "nan",
    }
    for name, placement in single.placement.items():
        assert placement == [0, 1], name
    rec = single.worker_results[0]["agn4"]
    _close(single.centers["agn4"], rec["center"][-1])
    assert single.stats.bytes_in > 0 and single.stats.bytes_out > 0


@pytest.mark.parametrize("kind, name", [("delta", "delta"), ("downpour", "DownpourOptimizer")])
def test_additive_rules_math(single, kind, name):
    out = single.worker_results[0]
    rec = out[kind]
    ref, _, _ = _simulate(kind, out[f"{kind}_c0"], rec["grads"], 2)
    for k, (local, center, version) in enumerate(ref):
        _close(rec["local"][k], local)
        _close(rec["center"][k], center)
        assert rec["global_step"][k] == version
    assert single.stats.per_optimizer[name]["global_step"] == 2


def test_easgd_math(single):
    out = single.worker_results[0]
    assert out["easgd_alpha"] == pytest.approx(0.9 / (2 * 2))  # TF's 0.9 / (τ n)
    rec = out["easgd"]
    ref, _, _ = _simulate("easgd", out["easgd_c0"], rec["grads"], 2, alpha=out["easgd_alpha"])
    for k, (local, center, version) in enumerate(ref):
        _close(rec["local"][k], local)
        _close(rec["center"][k], center)
        assert rec["global_step"][k] == version
    # EASGD pulls the local copy toward the center, it does not reset it
    assert not torch.equal(rec["local"][1][0], rec["center"][1][0])


def test_nan_commit_is_refused(single):
    out = single.worker_results[0]
    rec = out["nan"]
    assert rec["warned"][0] == [] and rec["warned"][2] == []
    assert len(rec["warned"][1]) == 1 and "refused" in rec["warned"][1][0]
    # step 1 refused: the center did not move, the local copy was reset to it
    assert all(torch.equal(a, b) for a, b in zip(rec["center"][1], rec["center"][0]))
    assert all(torch.equal(a, b) for a, b in zip(rec["local"][1], rec["center"][1]))
    assert all(torch.isfinite(c).all() for step in rec["center"] for c in step)
    assert rec["global_step"] == [1, 1, 2]
    direct = out["nan_direct"]
    assert direct.refused and direct.version == 2
    assert all(torch.isfinite(c).all() for c in out["nan_center_after"])
    assert single.stats.per_optimizer["nan"]["refused_commits"] == 1  # counted once per commit
    assert single.stats.refused_commits == 1


def test_checkpoint_restart_resume(single, ckpt_dir, tmp_path, transport):
    assert sorted(os.listdir(ckpt_dir)) == ["ps0.pt", "ps1.pt"]  # no temp files left behind
    first = single.worker_results[0]
    _, server_opt, center = _simulate(
        "gradient", first["agn4_c0"], first["agn4"]["grads"], 4, momentum=MOMENTUM
    )
    with pytest.raises(RankFailedError, match="ps 1") as info:  # the worker kills ps 1 at the end
        spawn(
            _resume_worker,
            1,
            num_ps=2,
            args=(str(tmp_path),),
            timeout=360,
            checkpoint_dir=ckpt_dir,
            transport=transport,
            rpc_timeout=30,
        )
    assert "killed by signal 9" in str(info.value)  # the root cause: the death, not its echo
    out = torch.load(tmp_path / "resume.pt")
    _close(out["after_init"], single.centers["agn4"])  # the checkpoint, not the new seed
    assert out["global_step_after_init"] == 2
    rec = out["run"]
    ref, _, _ = _simulate(
        "gradient",
        single.centers["agn4"],
        rec["grads"],
        4,
        momentum=MOMENTUM,
        server_opt=server_opt,
        center=center,
    )  # the server optimizer continues with its checkpointed momentum
    for k, (local, c, _) in enumerate(ref):
        _close(rec["local"][k], local)
        _close(rec["center"][k], c)
    assert rec["global_step"][-1] == 3
    assert "parameter server" in out["dead_ps_error"]
    assert "ps:1" in out["dead_ps_error"] or "parameter server 1" in out["dead_ps_error"]


def test_init_hook_seeds_from_chief(pair):
    _, out_dir = pair
    w0 = torch.load(out_dir / "worker0.pt")
    w1 = torch.load(out_dir / "worker1.pt")
    assert not torch.equal(w0["before_init"][0], w1["before_init"][0])
    for a, b in zip(w1["after_init"], w0["before_init"]):
        assert torch.equal(a, b)


def test_two_workers_lambda1_every_commit_moves_center_once(pair):
    result, out_dir = pair
    w = [torch.load(out_dir / f"worker{t}.pt") for t in (0, 1)]
    per = result.stats.per_optimizer["lam1"]
    assert per["global_step"] == 12 and per["commits_per_worker"] == {0: 6, 1: 6}
    assert sum(per["staleness_histogram"].values()) == 12
    # plain SGD on the server: each commit subtracts lr * g once, whatever the arrival order
    expected = [c.clone() for c in w[0]["before_init"]]
    for rec in (w[0]["lam1"], w[1]["lam1"]):
        for g in rec["grads"]:
            for e, gi in zip(expected, g):
                e -= LR * gi
    for c, e in zip(result.centers["lam1"], expected):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def test_sigkill_of_one_worker_does_not_stop_the_others(pair):
    result, _ = pair
    assert result.worker_results[1] is None
    assert result.worker_results[0]["kill_global_step"] >= 20
    assert result.stats.dead_workers == [1]
    per = result.stats.per_optimizer["kill"]
    assert per["commits_per_worker"][0] == 20 and per["commits_per_worker"][1] == 2
    assert per["global_step"] == 22


def test_tf_minimize_and_apply_gradients_commit_like_step(single):
    out = single.worker_results[0]
    tf = out["tf"]
    assert out["tf_iterations"] == 2 and tf["tf_global_step"] == 2
    assert tf["global_step"] == 1  # λ=2: the second update committed
    assert all(torch.equal(a, b) for a, b in zip(tf["local"], tf["center"]))
