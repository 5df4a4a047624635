"""AsyncDiLoCoOptimizer: exact math against plain-torch simulations, on both transports.

Without a cluster: Delayed Nesterov against arXiv 2401.09135's Algorithm 3 written out here,
Eq. (6) (DyLU), and every bad argument. On one local cluster per transport (one shard, two
workers, float64; module-scoped, several tables): one worker equals the synchronous
``distoptim.DiLoCo`` on one replica; two workers whose commits are put in a fixed order
through the cluster's store equal a hand simulation in that arrival order, with the default
Nesterov outer optimizer and with Delayed Nesterov; with fixed per-step costs (a fake clock)
DyLU gives the slow worker ``⌊v/v_max · H⌋`` steps per round while the fast one keeps ``H``.
"""

from __future__ import annotations

import copy
import functools
import io
from datetime import timedelta

import pytest
import torch

import distoptim
from distoptim.agn import DelayedNesterov, spawn
from distoptim.agn.async_diloco import local_updates

pytestmark = pytest.mark.timeout(420)  # above the cluster bound: a hang is the bound's error

TRANSPORTS = ["p2p", "rpc"]
ATOL = 1e-10
WAIT = timedelta(seconds=60)
NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


# ---------------------------------------------------------------------------------------------
# the references, written independently of distoptim
# ---------------------------------------------------------------------------------------------
class _Algorithm3:
    """arXiv 2401.09135, Algorithm 3 (Delayed Nesterov Update), literally, on a list of tensors."""

    def __init__(self, theta, eps, beta, n, c):
        self.theta, self.eps, self.beta, self.n, self.c = theta, eps, beta, n, c
        self.t = 0
        self.m = [torch.zeros_like(x) for x in theta]
        self.delta = [torch.zeros_like(x) for x in theta]

    def receive(self, g):
        eps, beta, n, c = self.eps, self.beta, self.n, self.c
        for i, gi in enumerate(g):
            self.delta[i] = self.delta[i] + gi
        if (self.t + 1) % n == 0:
            for i, gi in enumerate(g):
                self.m[i] = beta * self.m[i] + self.delta[i] / n
                self.theta[i] = self.theta[i] - eps * ((1 - c * n + c) * beta * self.m[i] + gi / n)
                self.delta[i] = torch.zeros_like(gi)
        else:
            for i, gi in enumerate(g):
                self.theta[i] = self.theta[i] - eps * (c * beta * self.m[i] + gi / n)
        self.t += 1


class _TorchOuter:
    """A torch outer optimizer over the center, stepped with a pseudo-gradient."""

    def __init__(self, theta, factory):
        self.params = [torch.nn.Parameter(x.clone()) for x in theta]
        self.opt = factory(self.params)

    @property
    def theta(self):
        return [p.detach() for p in self.params]

    def receive(self, g):
        for p, gi in zip(self.params, g):
            p.grad = gi.clone()
        self.opt.step()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(
        torch.float64
    )


def _batch(task: int, step: int):
    g = torch.Generator().manual_seed(1000 * task + step)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    return x, torch.randn(6, 2, generator=g, dtype=torch.float64)


def _inner(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _loss(model, task, step):
    x, y = _batch(task, step)
    return (model(x) - y).pow(2).mean()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=ATOL)


def _simulate(order, steps_per_round, outer):
    """Workers' rounds applied in ``order`` (a list of tasks): the local params after every
    step of each worker, and the center afterwards. ``outer`` holds the center."""
    workers = {}
    for task in sorted(set(order)):
        m = _model()
        with torch.no_grad():
            for p, c in zip(m.parameters(), outer.theta):
                p.copy_(c)
        workers[task] = {"model": m, "inner": _inner(m), "pulled": _params(m), "step": 0, "rec": []}
    for task in order:
        w = workers[task]
        for _ in range(steps_per_round):
            w["inner"].zero_grad()
            _loss(w["model"], task, w["step"]).backward()
            w["inner"].step()
            w["step"] += 1
            w["rec"].append(_params(w["model"]))
        delta = [p0 - p for p0, p in zip(w["pulled"], _params(w["model"]))]
        outer.receive(delta)
        with torch.no_grad():
            for p, c in zip(w["model"].parameters(), outer.theta):
                p.copy_(c)
        w["pulled"] = _params(w["model"])
        w["rec"][-1] = _params(w["model"])  # what the worker holds after the committing step
    return {t: w["rec"] for t, w in workers.items()}, [c.clone() for c in outer.theta]


# ---------------------------------------------------------------------------------------------
# no cluster
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, c", [(3, 0.0), (3, 0.2), (2, 0.5), (1, 0.0)])
def test_delayed_nesterov_is_algorithm_3(n, c):
    torch.manual_seed(1)
    theta0 = [torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    params = [torch.nn.Parameter(t.clone()) for t in theta0]
    dn = DelayedNesterov(params, lr=0.7, momentum=0.9, buffer_size=n, activation=c)
    ref = _Algorithm3([t.clone() for t in theta0], 0.7, 0.9, n, c)
    for _ in range(11):
        g = [torch.randn_like(t) for t in theta0]
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        dn.step()
        ref.receive(g)
        _close([p.detach() for p in params], ref.theta)
    state = dn.state[params[0]]
    assert state["step"] == 11
    _close([state["momentum_buffer"]], [ref.m[0]])
    _close([state["pseudo_gradient_sum"]], [ref.delta[0]])


def test_delayed_nesterov_with_one_step_buffer_is_torch_nesterov_bit_for_bit():
    torch.manual_seed(2)
    theta0 = [torch.randn(7, dtype=torch.float32), torch.randn(2, 3, dtype=torch.float32)]
    a = [torch.nn.Parameter(t.clone()) for t in theta0]
    b = [torch.nn.Parameter(t.clone()) for t in theta0]
    dn = DelayedNesterov(a, lr=0.7, momentum=0.9, buffer_size=1)
    sgd = NESTEROV(b)
    for _ in range(6):
        g = [torch.randn_like(t) for t in theta0]
        for pa, pb, gi in zip(a, b, g):
            pa.grad, pb.grad = gi.clone(), gi.clone()
        dn.step()
        sgd.step()
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": float("nan")}, "lr must be"),
        ({"lr": -1.0}, "lr must be"),
        ({"momentum": 1.0}, "momentum must be"),
        ({"buffer_size": 0}, "buffer_size must be"),
        ({"buffer_size": 2.0}, "buffer_size must be"),
        ({"buffer_size": 4, "activation": 0.3}, r"activation .* \[0, 0.25\]"),
        ({"activation": -0.1}, "activation"),
    ],
)
def test_delayed_nesterov_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DelayedNesterov([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_dynamic_local_updates_is_eq_6():
    assert local_updates(12, 1.0, 1.0) == 12  # the fastest worker keeps H
    assert local_updates(12, 2.0, 1.0) == 12  # a stale maximum never gives more than H
    assert local_updates(12, 0.5, 1.0) == 6
    assert local_updates(12, 0.3, 1.0) == 3  # ⌊3.6⌋
    assert local_updates(12, 1 / 3, 1.0) == 4  # exactly 4, not 3.999…
    assert local_updates(12, 0.01, 1.0) == 1  # at least one step
    assert local_updates(50, 3.0, 9.0) == 16


_OPT_ERRORS = [
    ({"communication_period": 0}, ValueError, "communication_period must be an int >= 1"),
    ({"num_worker": 0}, ValueError, "num_worker must be an int >= 1"),
    ({"delayed_momentum": -1}, ValueError, "delayed_momentum must be an int >= 0"),
    ({"delayed_momentum": 1.5}, ValueError, "delayed_momentum must be an int"),
    ({"delayed_momentum": True}, ValueError, "delayed_momentum must be an int"),
    ({"dynamic_local_updates": 1}, TypeError, "dynamic_local_updates must be True or False"),
    ({"outer_optimizer": "sgd"}, TypeError, "outer_optimizer must be a factory"),
    (
        {"outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=0.7)},
        TypeError,
        "outer_optimizer must be picklable",
    ),
    ({"outer_optimizer": dict}, ValueError, r"outer_optimizer\(params\) failed"),
    ({"outer_optimizer": list}, TypeError, "must return a torch.optim.Optimizer"),
    (
        {"outer_optimizer": functools.partial(torch.optim.SGD, lr=float("nan"))},
        ValueError,
        "lr=nan; it must be a finite number",
    ),
    (
        {"outer_optimizer": functools.partial(torch.optim.SGD, lr=-1.0)},
        ValueError,
        "Invalid learning rate",
    ),
    (
        {"outer_optimizer": functools.partial(torch.optim.Adam, lr=0.1), "delayed_momentum": 2},
        ValueError,
        "must build torch.optim.SGD",
    ),
    (
        {"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7), "delayed_momentum": 2},
        ValueError,
        "nesterov=True",
    ),
    ({"delayed_momentum": 4, "momentum_activation": 0.5}, ValueError, r"\[0, 0.25\]"),
    ({"momentum_activation": 0.1}, ValueError, "needs delayed_momentum >= 1"),
    ({"delayed_momentum": 2, "momentum_activation": float("inf")}, ValueError, "finite"),
    ({"clock": 3.0}, TypeError, "clock must be a callable"),
    ({"name": ""}, TypeError, "name must be a non-empty str"),
]


@pytest.mark.parametrize("kwargs, error, match", _OPT_ERRORS)
def test_bad_arguments_raise_before_anything_changes(kwargs, error, match):
    model = _model()
    inner = _inner(model)
    before = copy.deepcopy(inner.state_dict())
    args = {"num_worker": 2, **kwargs}
    with pytest.raises(error, match=match):
        distoptim.AsyncDiLoCoOptimizer(inner, **args)
    assert inner.state_dict() == before


def test_inner_must_be_a_finite_torch_optimizer():
    with pytest.raises(TypeError, match=r"wraps a torch\.optim\.Optimizer"):
        distoptim.AsyncDiLoCoOptimizer([torch.zeros(2)], 1)
    inner = torch.optim.SGD(_model().parameters(), lr=float("inf"))
    with pytest.raises(ValueError, match="lr=inf; it must be a finite number"):
        distoptim.AsyncDiLoCoOptimizer(inner, 1)


def test_defaults_and_state_dict_round_trip():
    model = _model()
    opt = distoptim.AsyncDiLoCoOptimizer(_inner(model), 4, delayed_momentum=4)
    assert opt.communication_period == opt.period == 50
    assert opt.outer_optimizer is distoptim.agn.async_diloco.DEFAULT_OUTER
    assert opt._server_factory.func is DelayedNesterov
    assert opt._server_factory.keywords == {
        "lr": 0.7,
        "momentum": 0.9,
        "buffer_size": 4,
        "activation": 0.0,
    }
    sd = opt.state_dict()
    assert sd["wrapper"] == {"local_step": 0, "global_step": 0, "round_steps": 0, "period": 50}
    sd["wrapper"] = {"local_step": 9, "global_step": 4, "round_steps": 3, "period": 7}
    opt.load_state_dict(sd)
    assert (opt.local_step, opt.global_step, opt._round_steps, opt.period) == (9, 4, 3, 7)
    for bad, match in [
        ({"period": 51}, "period must be <= communication_period"),
        ({"period": 0}, "period must be an int >= 1"),
        ({"round_steps": 7}, "round_steps must be < period"),
        ({"speed": 1.0}, "wrapper state has keys"),
        ({"local_step": -1}, "local_step"),
    ]:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict({**sd, "wrapper": {**sd["wrapper"], **bad}})
    assert (opt.local_step, opt.global_step, opt._round_steps, opt.period) == (9, 4, 3, 7)


# ---------------------------------------------------------------------------------------------
# on a cluster: one shard, two workers, several tables
# ---------------------------------------------------------------------------------------------
H = 2
ROUNDS = 3
ORDER = [0, 1] * ROUNDS  # the arrival order the workers enforce through the store
DN_N, DN_C = 3, 0.2
DYLU_H, DYLU_COST, DYLU_STEPS = 8, {0: 1.0, 1: 4.0}, 16


def _init(opt, ctx):
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()


def _step(opt, model, task, step):
    opt.zero_grad()
    _loss(model, task, step).backward()
    opt.step()


def _ordered(ctx, table, **kwargs):
    """Both workers, commits in ORDER: before the step that commits its round r, a worker
    waits until the previous commit in ORDER is done (a key in the cluster's store)."""
    store, task = ctx.store, ctx.task_index
    model = _model()
    opt = distoptim.AsyncDiLoCoOptimizer(
        _inner(model), ctx.num_worker, communication_period=H, name=table, **kwargs
    )
    _init(opt, ctx)
    if task == 1:
        store.set(f"test/{table}/pulled", "1")
    else:  # worker 1 starts from the seed too: nobody commits before it pulled
        store.wait([f"test/{table}/pulled"], WAIT)
    rec = []
    for r in range(ROUNDS):
        k = 2 * r + task  # this round's place in ORDER
        for s in range(H):
            if s == H - 1 and k > 0:
                store.wait([f"test/{table}/done/{k - 1}"], WAIT)
            _step(opt, model, task, r * H + s)
            rec.append(_params(model))
        store.set(f"test/{table}/done/{k}", "1")
    return {"local": rec, "global": opt.global_parameters(), "commits": opt.commits}


def _dylu(ctx):
    """Fixed per-step costs on a fake clock: worker 0 costs 1, worker 1 costs 4 per step.
    Worker 0 commits first; worker 1 commits its first round next; worker 0's second commit
    waits for it (so each sees the other's speed when it sizes its next round)."""
    store, task = ctx.store, ctx.task_index
    now = [0.0]
    model = _model()
    opt = distoptim.AsyncDiLoCoOptimizer(
        _inner(model),
        ctx.num_worker,
        communication_period=DYLU_H,
        dynamic_local_updates=True,
        name="dylu",
        clock=lambda: now[0],
    )
    _init(opt, ctx)
    periods, waits = [], {(1, DYLU_H): "w0r0", (0, 2 * DYLU_H): "w1r0"}
    for s in range(1, DYLU_STEPS + 1):
        if (task, s) in waits:
            store.wait([f"test/dylu/{waits[(task, s)]}"], WAIT)
        now[0] += DYLU_COST[task]
        _step(opt, model, task, s)
        periods.append(opt.period)
        if s == DYLU_H:
            store.set(f"test/dylu/w{task}r0", "1")
    # a worker that left no longer sets the pace: worker 0 stays until worker 1 is done
    if task == 1:
        store.set("test/dylu/w1done", "1")
    else:
        store.wait(["test/dylu/w1done"], WAIT)
    return {"periods": periods, "speed": opt.speed, "commits": opt.commits}


def _solo(ctx):
    """Worker 0 alone on its table (worker 1 never touches it): the one-worker case."""
    model = _model()
    opt = distoptim.AsyncDiLoCoOptimizer(
        _inner(model), ctx.num_worker, communication_period=3, name="solo"
    )
    _init(opt, ctx)
    rec = []
    for s in range(9):
        _step(opt, model, 0, s)
        rec.append(_params(model))
    return {
        "local": rec,
        "global": opt.global_parameters(),
        "center": opt.center_variables(),
        "bytes": opt.bytes_sent,
        "commits": opt.commits,
    }


def _worker(ctx):
    out = {}
    if ctx.task_index == 0:
        out["solo"] = _solo(ctx)
    out["order"] = _ordered(ctx, "order")
    out["dn"] = _ordered(ctx, "dn", delayed_momentum=DN_N, momentum_activation=DN_C)
    out["dylu"] = _dylu(ctx)
    return out


@pytest.fixture(scope="module", params=TRANSPORTS)
def run(request, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp(f"async_diloco_{request.param}")
    result = spawn(
        _worker,
        2,
        num_ps=1,
        timeout=360,  # generous: its ~15 CPU seconds take minutes at load 28 on 2 cores
        checkpoint_dir=ckpt,
        transport=request.param,
        rpc_timeout=30,
    )
    tables = torch.load(ckpt / "ps0.pt", weights_only=False)["tables"]
    return result, tables


def _server_state(tables, name):
    return torch.load(io.BytesIO(tables[name]["optimizer"]))["state"]


@pytest.mark.slow
def test_one_worker_is_diloco_on_one_replica(run):
    result, tables = run
    out = result.worker_results[0]["solo"]
    model = _model()
    outer = NESTEROV(model.parameters())
    diloco = distoptim.DiLoCo(_inner(model), outer, sync_every=3)
    for s in range(9):
        _step(diloco, model, 0, s)
        _close(out["local"][s], _params(model))
    _close(out["global"], diloco.global_parameters)
    _close(out["center"], diloco.global_parameters)
    _close(result.centers["solo"], diloco.global_parameters)
    server = _server_state(tables, "solo")  # the outer momentum lives on the shard
    _close(
        [server[i]["momentum_buffer"] for i in range(4)],
        [outer.state[p]["momentum_buffer"] for p in model.parameters()],
    )
    per = result.stats.per_optimizer["solo"]
    assert per["commits_per_worker"] == {0: 3} and out["commits"] == 3
    assert out["bytes"] == 3 * sum(p.numel() * 8 for p in model.parameters())


@pytest.mark.slow
def test_two_workers_follow_the_arrival_order(run):
    result, tables = run
    sim = _TorchOuter(_params(_model()), NESTEROV)
    rec, center = _simulate(ORDER, H, sim)
    for task in (0, 1):
        out = result.worker_results[task]["order"]
        for got, want in zip(out["local"], rec[task], strict=True):
            _close(got, want)
        assert out["commits"] == ROUNDS
    _close(result.centers["order"], center)
    _close(result.worker_results[1]["order"]["global"], center)  # worker 1 committed last
    server = _server_state(tables, "order")
    _close(
        [server[i]["momentum_buffer"] for i in range(4)],
        [sim.opt.state[p]["momentum_buffer"] for p in sim.params],
    )
    per = result.stats.per_optimizer["order"]
    assert per["commits_per_worker"] == {0: ROUNDS, 1: ROUNDS}
    # every commit after the first comes one center version after the worker's last pull
    assert per["staleness_histogram"] == {0: 1, 1: 2 * ROUNDS - 1}


@pytest.mark.slow
def test_delayed_nesterov_on_the_server_is_algorithm_3(run):
    result, tables = run
    ref = _Algorithm3(_params(_model()), 0.7, 0.9, DN_N, DN_C)
    rec, center = _simulate(ORDER, H, ref)
    for task in (0, 1):
        for got, want in zip(result.worker_results[task]["dn"]["local"], rec[task], strict=True):
            _close(got, want)
    _close(result.centers["dn"], center)
    server = _server_state(tables, "dn")
    assert [server[i]["step"] for i in range(4)] == [len(ORDER)] * 4
    _close([server[i]["momentum_buffer"] for i in range(4)], ref.m)
    _close([server[i]["pseudo_gradient_sum"] for i in range(4)], ref.delta)
    # and it is not the plain outer optimizer
    assert not torch.allclose(result.centers["dn"][0], result.centers["order"][0])


@pytest.mark.slow
def test_dynamic_local_updates_follow_the_measured_speeds(run):
    result, _ = run
    fast, slow = (result.worker_results[t]["dylu"] for t in (0, 1))
    assert fast["speed"] == 1.0 and slow["speed"] == 0.25  # steps per (fake) second
    assert fast["periods"] == [DYLU_H] * DYLU_STEPS  # the fastest keeps H
    slow_h = local_updates(DYLU_H, 0.25, 1.0)
    assert slow_h == 2
    assert slow["periods"] == [DYLU_H] * (DYLU_H - 1) + [slow_h] * (DYLU_STEPS - DYLU_H + 1)
    assert fast["commits"] == 2 and slow["commits"] == 1 + (DYLU_STEPS - DYLU_H) // slow_h
    per = result.stats.per_optimizer["dylu"]
    assert per["commits_per_worker"] == {0: fast["commits"], 1: slow["commits"]}
