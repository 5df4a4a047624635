"""distoptim.agn pieces that need no cluster: validation, placement, flat buffers, a PS shard."""

from __future__ import annotations

import copy
import math
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

import distoptim
from distoptim.agn import AGNCustomGetter, Cluster, ParameterServer, ShardLink, spawn
from distoptim.agn.flat import FlatLayout
from distoptim.agn.rules import AddUpdate, ApplyOptimizer, ElasticUpdate
from distoptim.agn.store import StoreUnreachableError, store_namespace
from distoptim.agn.transport import framing
from distoptim.agn.transport.messages import (
    Commit,
    ErrorReply,
    Finish,
    Ping,
    Pong,
    Pull,
    Request,
    Seed,
    TableSpec,
)

pytestmark = pytest.mark.timeout(60)


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 3)


def _sgd(m, **kw):
    return torch.optim.SGD(m.parameters(), lr=0.1, **kw)


# ---- bad input: a clear error, nothing mutated -------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"communication_period": 0}, ValueError, "communication_period must be an int >= 1"),
        ({"communication_period": 2.5}, ValueError, "communication_period"),
        ({"communication_period": True}, ValueError, "communication_period"),
        ({"num_worker": 0}, ValueError, "num_worker must be an int >= 1"),
        ({"custom_getter": lambda *a: None}, TypeError, "custom_getter must be"),
        ({"custom_getter": "round_robin"}, TypeError, "custom_getter must be"),
        ({"update_rule": "momentum"}, ValueError, "update_rule must be one of"),
        ({"use_locking": "yes"}, TypeError, "use_locking must be True or False"),
        ({"name": ""}, TypeError, "name must be a non-empty str"),
    ],
)
def test_agn_bad_arguments(kwargs, error, match):
    m = _model()
    inner = _sgd(m, momentum=0.9)
    before = copy.deepcopy(inner.state_dict())
    args = {"num_worker": 2, **kwargs}
    with pytest.raises(error, match=match):
        distoptim.AGNOptimizer(inner, **args)
    assert inner.state_dict() == before


@pytest.mark.parametrize("cls", ["AGNOptimizer", "DownpourOptimizer", "ElasticAverageOptimizer"])
def test_wrapped_must_be_a_torch_optimizer(cls):
    with pytest.raises(TypeError, match=r"wraps a torch\.optim\.Optimizer"):
        getattr(distoptim, cls)([torch.zeros(2)], 1)


@pytest.mark.parametrize("rate", [0, -0.1, 1.5, float("nan"), "0.1"])
def test_easgd_bad_moving_rate(rate):
    with pytest.raises(ValueError, match="moving_rate"):
        distoptim.ElasticAverageOptimizer(_sgd(_model()), 2, moving_rate=rate)


def test_easgd_default_moving_rate_is_tf_contrib():
    opt = distoptim.ElasticAverageOptimizer(_sgd(_model()), 4, communication_period=8)
    assert opt.moving_rate == pytest.approx(0.9 / (8 * 4))


def test_step_before_initialization_says_what_to_call():
    m = _model()
    opt = distoptim.AGNOptimizer(_sgd(m), 2, custom_getter=AGNCustomGetter(num_ps=1))
    before = [p.detach().clone() for p in m.parameters()]
    m(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="make_session_run_hook"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert opt.iterations == 0 and opt.local_step == 0
    with pytest.raises(RuntimeError, match="not connected"):
        opt.center_variables()


def test_hook_outside_a_cluster_and_bad_hook_arguments():
    opt = distoptim.AGNOptimizer(_sgd(_model()), 2)
    with pytest.raises(RuntimeError, match="not part of an AGN cluster"):
        opt.make_session_run_hook(True, 0).begin()
    with pytest.raises(TypeError, match="is_chief must be True or False"):
        opt.make_session_run_hook("yes", 0)
    with pytest.raises(ValueError, match="task_index"):
        opt.make_session_run_hook(True, -1)
    with pytest.raises(ValueError, match="task_index"):
        opt.get_init_op(-1)
    assert callable(opt.get_init_op(2))  # a late worker's task index exceeds num_worker - 1


def test_delegates_slots_and_state_dict():
    m = _model()
    opt = distoptim.AGNOptimizer(_sgd(m, momentum=0.9), 1)
    m(torch.ones(1, 2)).sum().backward()
    opt.wrapped.step()  # local optimizer state exists
    assert opt.get_slot_names() == ["momentum_buffer"]
    assert (
        opt.get_slot(m.weight, "momentum_buffer") is opt.wrapped.state[m.weight]["momentum_buffer"]
    )
    assert opt.get_name() == "AGNOptimizer"
    sd = opt.state_dict()
    assert sd["wrapper"] == {"local_step": 0, "global_step": 0}
    sd["wrapper"] = {"local_step": 7, "global_step": 3}
    opt.load_state_dict(sd)
    assert (opt.local_step, opt.global_step) == (7, 3)
    sd["wrapper"] = {"local_step": -1}
    with pytest.raises(ValueError, match="local_step"):
        opt.load_state_dict(sd)


def test_cluster_and_spawn_bad_input():
    with pytest.raises(RuntimeError, match="torchrun environment"):
        Cluster.from_env(num_ps=1)
    fn = test_cluster_and_spawn_bad_input
    for kwargs, match in [
        ({"num_worker": 0}, "num_worker"),
        ({"num_worker": 1, "num_ps": 0}, "num_ps"),
        ({"num_worker": 1, "timeout": -1}, "timeout"),
        ({"num_worker": 1, "checkpoint_every": 5}, "needs checkpoint_dir"),
        ({"num_worker": 1, "checkpoint_every": 0, "checkpoint_dir": "/tmp/x"}, "checkpoint_every"),
        ({"num_worker": 1, "strategy": "random"}, "strategy"),
        ({"num_worker": 1, "transport": "tcp"}, "unknown transport .tcp."),
        ({"num_worker": 1, "max_restarts": 1}, "max_restarts needs checkpoint_dir"),
        ({"num_worker": 1, "max_restarts": -1}, "max_restarts"),
        (
            {"num_worker": 1, "max_restarts": 1, "checkpoint_dir": "/tmp/x", "transport": "rpc"},
            "needs transport='p2p'",
        ),
        ({"num_worker": 1, "on_startup_failure": "ignore"}, "on_startup_failure"),
        ({"num_worker": 1, "on_startup_failure": "drop", "transport": "rpc"}, "p2p"),
        ({"num_worker": 1, "reconnect_timeout": -1.0}, "reconnect_timeout"),
    ]:
        with pytest.raises(ValueError, match=match):
            spawn(fn, **kwargs)
    with pytest.raises(TypeError, match="args must be a tuple"):
        spawn(fn, 1, args=[1])
    with pytest.raises(TypeError, match="worker_fn must be callable"):
        spawn(None, 1)


# ---- placement ---------------------------------------------------------------------------------
def test_getter_round_robin_and_size_balanced():
    params = [torch.zeros(1000), torch.zeros(10), torch.zeros(10), torch.zeros(10)]
    assert AGNCustomGetter(num_ps=2).placement(params) == [0, 1, 0, 1]
    assert AGNCustomGetter(2, "size_balanced").placement(params) == [0, 1, 1, 1]
    assert AGNCustomGetter().placement(params, num_ps=3) == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="no num_ps"):
        AGNCustomGetter().placement(params)
    with pytest.raises(ValueError, match="num_ps"):
        AGNCustomGetter(num_ps=0)
    with pytest.raises(ValueError, match="strategy"):
        AGNCustomGetter(strategy="greedy")


def test_flat_layout_views_share_storage_and_flatten_copies():
    ts = [torch.randn(2, 3), torch.randn(4, dtype=torch.float64), torch.randn(5)]
    layout = FlatLayout([(t.shape, t.dtype) for t in ts])
    assert layout.sizes == {"float32": 11, "float64": 4}
    flats = layout.flatten(ts)
    views = layout.views(flats)
    assert all(torch.equal(a, b) for a, b in zip(ts, views))
    views[2].fill_(1.0)
    assert torch.equal(flats["float32"][6:], torch.ones(5))
    assert not torch.equal(ts[2], torch.ones(5))
    with pytest.raises(ValueError, match="1-D tensor of 11"):
        layout.check(
            {"float32": torch.zeros(3), "float64": torch.zeros(4, dtype=torch.float64)}, "x"
        )


# ---- early errors: bad parameters and hyperparameters, named ---------------------------------
@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: torch.nn.Linear(2, 3, device="meta").parameters(), TypeError, "meta device"),
        (lambda: [torch.zeros(3, dtype=torch.int64)], TypeError, "not floating point"),
        (
            lambda: [torch.nn.Parameter(torch.zeros(2)), torch.zeros(2, 2).to_sparse()],
            TypeError,
            r"param_groups\[0\]\['params'\]\[1\].*sparse",
        ),
    ],
)
@pytest.mark.parametrize("cls", ["AGNOptimizer", "DownpourOptimizer", "ElasticAverageOptimizer"])
def test_unsupported_parameters_fail_at_construction_naming_them(cls, make, error, match):
    inner = torch.optim.SGD(list(make()), lr=0.1)
    with pytest.raises(error, match=match):
        getattr(distoptim, cls)(inner, 2)


@pytest.mark.parametrize("bad", [{"lr": float("nan")}, {"momentum": float("inf")}])
def test_non_finite_hyperparameters_are_refused(bad):
    m = _model()
    inner = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    inner.param_groups[0].update(bad)
    with pytest.raises(ValueError, match=r"AGNOptimizer: param group 0 .* must be a finite"):
        distoptim.AGNOptimizer(inner, 2)


def test_load_state_dict_validates_before_changing_anything():
    m = _model()
    opt = distoptim.AGNOptimizer(_sgd(m, momentum=0.9), 1)
    m(torch.ones(1, 2)).sum().backward()
    opt.wrapped.step()
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["wrapper"] = {"local_step": -3}
    bad["state"] = {}  # would wipe the momentum if it were loaded first
    with pytest.raises(ValueError, match="local_step"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["wrapper"] == before["wrapper"]
    assert torch.equal(after["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])


# ---- one shard, called directly ----------------------------------------------------------------
def _spec(rule, params, opt=None, use_locking=True):
    return TableSpec(
        algorithm="test",
        rule=rule,
        param_indices=list(range(len(params))),
        shapes=[tuple(p.shape) for p in params],
        dtypes=[p.dtype for p in params],
        use_locking=use_locking,
        optimizer_cls=None if opt is None else type(opt),
        defaults={} if opt is None else dict(opt.defaults),
        groups=[]
        if opt is None
        else [
            (
                0,
                {k: v for k, v in opt.param_groups[0].items() if k != "params"},
                list(range(len(params))),
            )
        ],
    )


def _seed(ps, name, spec, flats):
    return ps.seed(Seed(name, spec, flats)).reply


def _pull(ps, name, layout, task=1, algorithm="test", wait_s=0.0):
    return ps.pull(Pull(name, task, algorithm, layout.signature(), wait_s)).reply


def _commit(ps, name, task, pulled, flats, live=False):
    handled = ps.commit(Commit(name, task, pulled, flats), live_reply=live)
    return handled


def test_shard_applies_server_optimizer_refuses_nan_and_resumes(tmp_path):
    params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(3))]
    ref_opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    spec = _spec(ApplyOptimizer(), params, ref_opt)
    layout = spec.layout()
    stale = tmp_path / ".ps0.abc123"  # what a shard killed mid-checkpoint leaves behind
    stale.write_bytes(b"")
    ps = ParameterServer(0, 1, 2, checkpoint_dir=tmp_path, checkpoint_every=2)
    assert not stale.exists() and ps.removed_temporaries == [str(stale)]
    with pytest.raises(RuntimeError, match="no center variables"):
        _pull(ps, "t", layout)
    _seed(ps, "t", spec, layout.flatten(params))
    grads = [torch.full((2, 2), 0.25), torch.arange(3.0)]
    for task in (0, 1):
        r = _commit(ps, "t", task, 0, layout.flatten(grads)).reply
        assert not r.refused and r.version == task + 1 and r.staleness == task
        for p, g in zip(params, grads):
            p.grad = g.clone()
        ref_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(layout.views(r.flats), params))
    bad = layout.flatten([torch.full((2, 2), float("nan")), torch.zeros(3)])
    r = _commit(ps, "t", 1, 2, bad).reply
    assert r.refused and r.version == 2 and "NaN/Inf" in r.reason
    assert all(torch.equal(a, b) for a, b in zip(layout.views(r.flats), params))
    with pytest.raises(ValueError, match="must build the same model"):
        ps.pull(Pull("t", 1, "test", FlatLayout([((4,), torch.float32)]).signature(), 0.0))
    with pytest.raises(ValueError, match="seeded by the chief as test"):
        _pull(ps, "t", layout, algorithm="other")
    with pytest.raises(ValueError, match="commit payload"):
        _commit(ps, "t", 1, 2, {"float32": torch.zeros(5)})
    # handle(): one method per request type; errors come back as values of the right kind
    err = ps.handle(Commit("t", 1, 2, {"float32": torch.zeros(5)})).reply
    assert isinstance(err, ErrorReply) and isinstance(err.to_exception(), ValueError)
    assert isinstance(ps.handle(Ping()).reply, Pong)
    assert isinstance(ps.handle(Request()).reply, ErrorReply)

    # checkpoint written at version 2; a new shard resumes center, optimizer state, counters
    ps2 = ParameterServer(0, 1, 2, checkpoint_dir=tmp_path)
    rep = ps2.report()["tables"]["t"]
    assert rep["resumed"] and rep["counters"]["version"] == 2
    assert rep["counters"]["commits"] == {0: 1, 1: 1}
    assert all(torch.equal(a, b) for a, b in zip(rep["center"], params))
    r = _commit(ps2, "t", 0, 2, layout.flatten(grads)).reply
    for p, g in zip(params, grads):
        p.grad = g.clone()
    ref_opt.step()  # same momentum buffer as the checkpointed one
    assert all(torch.equal(a, b) for a, b in zip(layout.views(r.flats), params))
    with pytest.raises(ValueError, match="num_ps=1"):
        ParameterServer(0, 2, 2, checkpoint_dir=tmp_path)


def test_center_guard_refuses_a_finite_commit_with_a_non_finite_result_exactly():
    """The issue's case: a finite commit with a huge learning rate would make the center Inf."""
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = torch.optim.SGD(params, lr=1e38, momentum=0.9)
    spec = _spec(ApplyOptimizer(), params, opt)
    layout = spec.layout()
    ps = ParameterServer(0, 1, 1)
    _seed(ps, "t", spec, layout.flatten(params))
    good = _commit(ps, "t", 0, 0, layout.flatten([torch.full((4,), 1e-38)])).reply
    assert not good.refused
    table = ps._tables["t"]
    center = table.flats["float32"].clone()
    momentum = table.server_opt.state_dict()["state"][0]["momentum_buffer"].clone()
    ps.idle()  # between requests the backup is taken ahead: the commit does not copy
    assert table.backup.versions == [1] and table.version == 1
    r = _commit(ps, "t", 0, 1, layout.flatten([torch.full((4,), 10.0)])).reply
    assert r.refused and "non-finite" in r.reason and r.version == 1
    assert torch.equal(table.flats["float32"], center)  # exactly as before, state too
    assert torch.equal(table.server_opt.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert torch.isfinite(r.flats["float32"]).all()
    counters = ps.report()["tables"]["t"]["counters"]
    assert counters["refused"] == 1 and counters["refused_result"] == 1
    # the next sane commit is accepted from the unchanged state
    assert not _commit(ps, "t", 0, 1, layout.flatten([torch.full((4,), 1e-38)])).reply.refused

    # additive rules: a bound proves most commits safe; near overflow, the exact check refuses
    big = torch.finfo(torch.float32).max * 0.6
    spec = _spec(AddUpdate(), [torch.zeros(3)])
    _seed(ps, "a", spec, {"float32": torch.full((3,), big)})
    r = _commit(ps, "a", 0, 0, {"float32": torch.tensor([big, 0.0, 0.0])}).reply
    assert r.refused and "non-finite" in r.reason
    assert torch.equal(ps._tables["a"].flats["float32"], torch.full((3,), big))
    r = _commit(ps, "a", 0, 0, {"float32": torch.tensor([-big, 1.0, 0.0])}).reply
    assert not r.refused and torch.equal(r.flats["float32"], torch.tensor([0.0, big + 1, big]))
    r = _commit(ps, "a", 0, 1, {"float32": torch.tensor([float("inf"), 0.0, 0.0])}).reply
    assert r.refused and "contained NaN/Inf" in r.reason


def test_elastic_rule_replies_the_old_center():
    spec = _spec(ElasticUpdate(0.5), [torch.zeros(2)])
    ps = ParameterServer(0, 1, 1)
    _seed(ps, "e", spec, {"float32": torch.tensor([0.0, 2.0])})
    for live in (False, True):
        before = ps._tables["e"].flats["float32"].clone()
        handled = _commit(ps, "e", 0, 0, {"float32": torch.tensor([4.0, 4.0])}, live=live)
        assert torch.equal(handled.reply.flats["float32"], before)
        handled.sent()  # releases the read lock of a live reply
    assert torch.equal(ps._tables["e"].flats["float32"], torch.tensor([3.0, 3.5]))


def test_shard_lock_serializes_concurrent_commits():
    params = [torch.zeros(1000)]
    spec = _spec(AddUpdate(), params)
    layout = spec.layout()
    ps = ParameterServer(0, 1, 4)
    _seed(ps, "t", spec, layout.flatten(params))

    def work(task):
        for i in range(100):  # a payload is consumed by the shard (its buffers carry the reply)
            handled = _commit(ps, "t", task, 0, layout.flatten([torch.ones(1000)]), live=i % 2)
            handled.sent()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    rep = ps.report()["tables"]["t"]
    assert torch.equal(rep["center"][0], torch.full((1000,), 400.0))
    assert rep["counters"]["version"] == 400
    assert rep["counters"]["commits"] == {0: 100, 1: 100, 2: 100, 3: 100}
    assert sum(rep["counters"]["staleness"].values()) == 400


def test_live_reply_holds_the_read_lock_until_sent():
    spec = _spec(AddUpdate(), [torch.zeros(2)])
    ps = ParameterServer(0, 1, 2)
    _seed(ps, "t", spec, {"float32": torch.zeros(2)})
    first = _commit(ps, "t", 0, 0, {"float32": torch.ones(2)}, live=True)
    assert first.reply.flats["float32"] is ps._tables["t"].flats["float32"]  # no copy
    done = threading.Event()

    def second():
        _commit(ps, "t", 1, 0, {"float32": torch.ones(2)}, live=True).sent()
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not done.wait(0.3)  # the second commit waits while the first reply is being sent
    assert torch.equal(first.reply.flats["float32"], torch.ones(2))
    first.sent()
    assert done.wait(10)
    t.join(10)


def test_wait_for_workers_ends_on_finish_failure_or_death():
    ps = ParameterServer(0, 1, 4)
    ps.finish(0, failed=False)
    ps.handle(Finish(3, failed=True))
    probes = []

    def gone(pending):
        probes.append(list(pending))
        if len(probes) == 1:
            ps.finish(2, failed=False)  # finished meanwhile: never counted dead
            return {1: "dead", 2: "dead"}
        return {}

    ps.wait_for_workers(gone, probe_period_s=0.01, timeout_s=10)
    rep = ps.report()
    assert rep["dead_workers"] == [1] and rep["finished_workers"] == [0, 2]
    assert rep["failed_workers"] == [3]
    # elastic: a late worker (task 4) counts once it exists; a lost connection is a death
    ps5 = ParameterServer(0, 1, 1)
    ps5.finish(0, failed=False)
    ps5.connection_lost(1)
    ps5.wait_for_workers(lambda pending: {}, 0.01, 10, task_count=lambda: 2)
    assert ps5.report()["dead_workers"] == [1]
    ps3 = ParameterServer(0, 1, 1)
    with pytest.raises(TimeoutError, match="neither finished nor died"):
        ps3.wait_for_workers(lambda pending: {}, probe_period_s=0.01, timeout_s=0.05)
    assert math.isfinite(rep["wall_time_s"])


class _KeepsGrad(torch.optim.SGD):
    """An optimizer whose state keeps the gradient tensor itself (not a copy)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["last_grad"] = p.grad
        return super().step(closure)


def test_reply_buffer_reuse_never_touches_optimizer_state_or_live_center():
    params = [torch.nn.Parameter(torch.zeros(4))]
    spec = _spec(ApplyOptimizer(), params, _KeepsGrad(params, lr=1.0))
    layout = spec.layout()
    ps = ParameterServer(0, 1, 1)
    _seed(ps, "t", spec, layout.flatten(params))
    payload = layout.flatten([torch.ones(4)])
    r = _commit(ps, "t", 0, 0, payload).reply
    assert torch.equal(r.flats["float32"], torch.full((4,), -1.0))
    kept = ps._tables["t"].optimizer.state[ps._tables["t"].views[0]]["last_grad"]
    assert torch.equal(kept, torch.ones(4))  # the kept gradient owns its memory now
    assert kept.data_ptr() != payload["float32"].data_ptr()

    # use_locking=False: additive commits reply with the live center (no snapshot)
    spec = _spec(AddUpdate(), params, use_locking=False)
    _seed(ps, "u", spec, layout.flatten([torch.zeros(4)]))
    r = _commit(ps, "u", 0, 0, layout.flatten([torch.ones(4)])).reply
    assert r.flats["float32"] is ps._tables["u"].flats["float32"]
    assert torch.equal(r.flats["float32"], torch.ones(4)) and r.version == 1


# ---- the p2p framing and the extension point -----------------------------------------------
def test_framing_roundtrip_inline_and_large_metadata():
    flats = {"float32": torch.arange(5.0), "float64": torch.ones(2, dtype=torch.float64)}
    for hparams in (None, {0: {f"k{i}": float(i) for i in range(100)}}):  # fits / does not fit
        msg = Commit("opt", 3, 7, flats, hparams, False)
        header, extra, buffers = framing.encode(msg)
        assert header.numel() == framing.HEADER_BYTES and (extra is None) == (hparams is None)
        n, meta = framing.decode_header(header)
        meta = meta if meta is not None else bytes(extra.numpy())
        assert len(meta) == n
        bare, specs, stream = framing.finish_decode(meta)
        assert stream is None
        assert bare.flats == {} and bare.hparams == hparams and bare.pulled_version == 7
        assert [(b.key, b.dtype, b.numel) for b in specs] == [
            ("float32", torch.float32, 5),
            ("float64", torch.float64, 2),
        ]
        assert [b.data_ptr() for b in buffers] == [t.data_ptr() for t in flats.values()]
    # a streamed message: no buffer goes whole, the plan travels in the metadata
    header, extra, buffers = framing.encode(msg, stream=framing.StreamInfo(16, 40))
    _, meta = framing.decode_header(header)
    if meta is None:
        meta = bytes(extra.numpy())
    assert buffers == [] and framing.finish_decode(meta)[2] == framing.StreamInfo(16, 40)
    bad = torch.zeros(framing.HEADER_BYTES, dtype=torch.uint8)
    with pytest.raises(framing.FramingError, match="bad message header"):
        framing.decode_header(bad)


def test_shard_link_is_the_public_extension_point():
    assert distoptim.agn.ShardLink is ShardLink
    p = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))]
    link = ShardLink(0, [0, 1], p, FlatLayout([(t.shape, t.dtype) for t in p]))
    link.assign({"float32": torch.arange(7.0)})
    assert torch.equal(p[1].detach(), torch.tensor([4.0, 5.0, 6.0]))
    assert torch.equal(link.local()["float32"], torch.arange(7.0))
    assert link.reply_buffers() is link.reply_buffers()
    # docs/agn.md's whole-buffer algorithm commits link.delta(divisor=2): (θ - θ_pulled) / 2
    link.pulled = {"float32": torch.ones(7)}
    assert torch.equal(link.delta(divisor=2)["float32"], (torch.arange(7.0) - 1) / 2)


def _serve_with_store(world_size: int, prepare: Callable[[Any], None]) -> tuple[Any, float]:
    """A shard in this process (p2p: no other process needed to serve) with a 0.2 s
    ``rpc_timeout``: ``prepare(store)`` sets the workers' keys, then the shard serves until
    every expected worker ended; its report and how long serving took."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cluster = Cluster(
        rank=0,
        world_size=world_size,
        num_ps=1,
        master_addr="127.0.0.1",
        master_port=store.port,
        rpc_timeout=0.2,
        probe_period_s=0.05,
    )
    try:
        prepare(cluster.store)
        t0 = time.monotonic()
        report = cluster.serve(timeout=10)
        return report, time.monotonic() - t0
    finally:
        cluster.shutdown()


def test_a_late_worker_that_never_comes_up_is_counted_dead_after_its_start_up_bound():
    """One expected worker finishes, a late one reserves its index and never connects."""

    def prepare(store: Any) -> None:
        store.set("worker/0/end", "finished")
        assert store.add("late", 1) == 1  # task 1 reserved, never up

    report, waited = _serve_with_store(2, prepare)
    assert report.finished_workers == [0] and report.dead_workers == [1]
    assert waited < 5  # the 0.4 s bound, not serve's timeout


def test_a_worker_that_dies_while_connecting_is_counted_dead_after_its_start_up_bound():
    """An expected worker marked ``starting`` (its whole node died while it connected: no
    launcher will mark its end) is dead after twice rpc_timeout, not waited for forever."""

    def prepare(store: Any) -> None:
        store.set("worker/0/end", "finished")
        store.set("worker/1/starting", "1")  # reached the cluster, never connected

    report, waited = _serve_with_store(3, prepare)
    assert report.finished_workers == [0] and report.dead_workers == [1]
    assert waited < 5  # the 0.4 s bound, not serve's timeout


def test_a_first_connection_moves_on_when_its_incarnation_died_before_serving_it():
    """A worker that queued its first connection with an incarnation that died before serving
    it (incarnation 1 here: nobody ever serves its queue) connects to the restarted shard
    (incarnation 2) within a window, not after its whole start-up bound."""
    import torch.distributed as dist

    from distoptim.agn.transport.p2p import _FIRST_WINDOW_S, P2PTransport

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    namespace = store_namespace()  # the Cluster below (this job's) uses it
    ns = dist.PrefixStore(namespace, store)
    assert ns.add("shard/0/incarnation", 1) == 1  # incarnation 1 started and died unseen
    worker = P2PTransport("127.0.0.1", store.port, namespace, num_ps=1, timeout=60)
    out: dict[str, Any] = {}

    def connect() -> None:
        t0 = time.monotonic()
        try:
            worker.connect(1, timeout=60)
            out["incarnation"] = worker.incarnation(0)
        except BaseException as exc:  # reported by the asserts below
            out["error"] = exc
        out["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=connect)
    thread.start()
    ns.wait(["shard/0/1/next"], timedelta(seconds=30))  # it asked incarnation 1
    shard = Cluster(
        rank=0,
        world_size=2,
        num_ps=1,
        master_addr="127.0.0.1",
        master_port=store.port,
        rpc_timeout=60,
    )  # the restart: incarnation 2
    try:
        thread.join(60)
    finally:
        worker.close()
        shard.shutdown()
    assert "error" not in out, out
    assert out["incarnation"] == 2
    assert out["seconds"] < 3 * _FIRST_WINDOW_S  # one window on the dead one, not 60 s


# ---- checkpoints that go wrong say which file and why --------------------------------------------
def test_checkpoint_problems_name_the_file_and_the_cause(tmp_path):
    """A corrupt file, a stale one from another model, a directory removed during the run, and a
    restart that finds the checkpoint of its own run gone: each named, at once."""
    import torch.distributed as dist

    params = [torch.nn.Parameter(torch.ones(2, 4)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD(params, lr=0.5)
    spec = _spec(ApplyOptimizer(), params, opt)
    layout = spec.layout()
    path = tmp_path / "ps0.pt"
    at = re.escape(str(path))
    path.write_bytes(b"\x80\x04garbage")  # what a crash or a copy cut short leaves
    with pytest.raises(ValueError, match=f"checkpoint {at} cannot be read .*corrupt"):
        ParameterServer(0, 1, 1, checkpoint_dir=tmp_path)
    path.unlink()

    # a checkpoint of model A, then a chief (and a worker) that build model B
    store = dist.HashStore()
    ps = ParameterServer(0, 1, 1, checkpoint_dir=tmp_path, checkpoint_every=1, store=store)
    _seed(ps, "t", spec, layout.flatten(params))
    assert path.exists()  # written when the table was seeded: a restart can resume it
    other = [torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.zeros(3))]
    other_spec = _spec(ApplyOptimizer(), other, torch.optim.SGD(other, lr=0.5))
    resumed = ParameterServer(0, 1, 1, checkpoint_dir=tmp_path)
    err = resumed.handle(Seed("t", other_spec, other_spec.layout().flatten(other))).reply
    assert isinstance(err, ErrorReply) and err.kind == "ValueError", err
    assert f"resumed from checkpoint {path}, which holds" in err.message
    assert "remove it or use another checkpoint_dir" in err.message
    assert "the chief seeded" not in err.message
    with pytest.raises(ValueError, match=f"worker 1's parameters .* checkpoint {at}"):
        _pull(resumed, "t", other_spec.layout())

    # the directory is removed while the shard runs: the commit that makes a checkpoint due
    # is answered with the real cause
    shutil.rmtree(tmp_path)
    grads = layout.flatten([torch.ones(2, 4), torch.ones(2)])
    err = ps.handle(Commit("t", 0, 0, grads)).reply
    assert isinstance(err, ErrorReply) and err.kind == "RuntimeError", err
    assert f"could not write its checkpoint {path}" in err.message
    assert "checkpoint_dir removed during the run" in err.message
    # ... and a restart of that shard in the same run says its checkpoint is gone, at once
    with pytest.raises(RuntimeError, match=f"its checkpoint {at}, written earlier"):
        ParameterServer(0, 1, 1, checkpoint_dir=tmp_path, store=store)


# ---- joining a cluster: every wait bounded, a wrong address named at once ----------------------
@pytest.fixture
def mute_port():
    """A port where something accepts connections and never answers (another service)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    for conn in accepted:  # the store clients' handshake threads see the end and stop
        conn.close()
    server.close()
    for t in threading.enumerate():  # (their farewell warnings stay in this test's capture)
        if t.name == "agn-store-handshake":
            t.join(10)


MUTE = r"did not answer as a torch\.distributed store"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_joining_a_wrong_address_is_named_at_once_and_a_mute_one_within_rpc_timeout(
    mute_port, monkeypatch
):
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=r"nothing listens at 127\.0\.0\.1:.*refused"):
        Cluster.join("127.0.0.1", _free_port(), rpc_timeout=30)
    with pytest.raises(StoreUnreachableError, match=r"'no-such-host\.invalid' cannot be resolved"):
        Cluster.join("no-such-host.invalid", 29500, rpc_timeout=30)
    assert time.monotonic() - t0 < 10  # at once, not after rpc_timeout
    for bad, why in [
        ("abc", "no host and port"),
        ("node7:port", "the port 'port' is not a number"),
        ("node7:0", "port 0 is not in"),
    ]:
        monkeypatch.setenv("DISTOPTIM_AGN_JOIN", bad)
        expected = f"DISTOPTIM_AGN_JOIN='{bad}' must be HOST:PORT.*{why}"
        with pytest.raises(ValueError, match=expected):
            Cluster.from_env()
    # something else listens there: bounded by rpc_timeout (it never returned)
    monkeypatch.setenv("DISTOPTIM_AGN_JOIN", f"127.0.0.1:{mute_port}")
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=MUTE):
        Cluster.from_env(rpc_timeout=1)
    assert time.monotonic() - t0 < 10
    # the same under torchrun's variables (e.g. MASTER_PORT under python -m distoptim.cli.train)
    monkeypatch.delenv("DISTOPTIM_AGN_JOIN")
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for k, v in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(mute_port)}.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=MUTE):
        Cluster.from_env(rpc_timeout=1)
    assert time.monotonic() - t0 < 10
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(StoreUnreachableError, match="nothing listens"):
        Cluster.from_env(rpc_timeout=30)
    assert time.monotonic() - t0 < 15
