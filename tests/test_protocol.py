"""The TF-style protocol on a plain torch.optim.SGD wrapper (docs/protocol.md)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from distoptim.protocol import TFOptimizerProtocol, WrappedOptimizer


def _setup(momentum: float = 0.9):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 2))
    b = torch.nn.Parameter(torch.randn(2))
    unused = torch.nn.Parameter(torch.randn(4))
    x = torch.randn(5, 3)
    opt = WrappedOptimizer(torch.optim.SGD([w, b, unused], lr=0.1, momentum=momentum))
    return opt, (w, b, unused), x


def _loss(w, b, x):
    return ((x @ w + b) ** 2).mean()


def test_is_a_torch_optimizer_with_tf_methods():
    opt, _, _ = _setup()
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(opt, TFOptimizerProtocol)
    assert (opt.GATE_NONE, opt.GATE_OP, opt.GATE_GRAPH) == (0, 1, 2)
    assert opt.get_name() == "WrappedOptimizer"
    assert (
        WrappedOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), "x").get_name()
        == "x"
    )
    assert opt.param_groups is opt.wrapped.param_groups


def test_compute_gradients_pairs_none_and_no_side_effects():
    opt, (w, b, unused), x = _setup()
    before = [p.detach().clone() for p in (w, b, unused)]
    pairs = opt.compute_gradients(_loss(w, b, x))
    assert [v for _, v in pairs] == [w, b, unused]
    assert pairs[2][0] is None
    ref_w, ref_b = torch.autograd.grad(_loss(w, b, x), [w, b])
    torch.testing.assert_close(pairs[0][0], ref_w)
    torch.testing.assert_close(pairs[1][0], ref_b)
    assert all(p.grad is None for p in (w, b, unused))
    for p, p0 in zip((w, b, unused), before):
        torch.testing.assert_close(p.detach(), p0)


def test_compute_gradients_callable_var_list_and_grad_loss():
    opt, (w, b, _), x = _setup()
    (g1,) = [g for g, _ in opt.compute_gradients(lambda: _loss(w, b, x), var_list=[b])]
    (g3,) = [g for g, _ in opt.compute_gradients(lambda: _loss(w, b, x), [b], torch.tensor(3.0))]
    torch.testing.assert_close(g3, 3 * g1)
    frozen = torch.randn(2)  # does not require grad -> None, not an error
    assert opt.compute_gradients(lambda: _loss(w, b, x), [b, frozen])[1][0] is None


def test_apply_gradients_matches_step_and_restores_grads():
    opt, (w, b, unused), x = _setup()
    ref_w, ref_b = (p.detach().clone().requires_grad_() for p in (w, b))
    ref = torch.optim.SGD([ref_w, ref_b], lr=0.1, momentum=0.9)
    w.grad = torch.full_like(w, 7.0)  # a user's accumulated grad must survive
    for _ in range(3):
        pairs = opt.compute_gradients(lambda: _loss(w, b, x))
        assert opt.apply_gradients(pairs) == opt.iterations
        ref.zero_grad()
        _loss(ref_w, ref_b, x).backward()
        ref.step()
    torch.testing.assert_close(w.detach(), ref_w.detach())
    torch.testing.assert_close(b.detach(), ref_b.detach())
    assert opt.iterations == 3
    assert torch.equal(w.grad, torch.full_like(w, 7.0)) and b.grad is None
    assert opt.get_slot(w, "momentum_buffer") is opt.wrapped.state[w]["momentum_buffer"]
    assert opt.get_slot(unused, "momentum_buffer") is None
    assert opt.get_slot(w, "nope") is None
    assert opt.get_slot_names() == ["momentum_buffer"]
    assert len(opt.variables()) == 2


def test_global_step_and_minimize():
    opt, (w, b, _), x = _setup()
    step = torch.tensor(5)
    assert opt.minimize(lambda: _loss(w, b, x), global_step=step, gate_gradients=opt.GATE_NONE) == 1
    assert step.item() == 6
    assert opt.minimize(_loss(w, b, x), var_list=[w], global_step=step) == 2
    assert step.item() == 7


def test_state_dict_round_trip_keeps_iterations():
    opt, (w, b, unused), x = _setup()
    for _ in range(2):
        opt.minimize(lambda: _loss(w, b, x))
    sd = opt.state_dict()
    assert sd["iterations"] == 2
    opt2 = WrappedOptimizer(torch.optim.SGD([w, b, unused], lr=0.5, momentum=0.9))
    opt2.load_state_dict(sd)
    assert opt2.iterations == 2
    assert opt2.param_groups[0]["lr"] == 0.1
    torch.testing.assert_close(
        opt2.get_slot(w, "momentum_buffer"), opt.get_slot(w, "momentum_buffer")
    )
    for bad in (-1, True, 2.0):  # a bool is no step count (True was loaded as 1)
        with pytest.raises(ValueError, match=r"state_dict\['iterations'\] must be an int >= 0"):
            opt2.load_state_dict({**sd, "iterations": bad})
    assert opt2.iterations == 2
    opt2.load_state_dict({**sd, "iterations": np.int64(3)})
    assert opt2.iterations == 3 and type(opt2.iterations) is int


def test_state_dict_keeps_a_wrapped_keras_optimizers_own_step_count():
    """A Keras-style inner (its own ``iterations`` drives its schedule) stepped before it was
    wrapped: its count, not the wrapper's, comes back on load."""
    from distoptim.dtensor import SGD

    def schedule(t):
        return 0.1 / (1 + t)

    w = torch.zeros(3, requires_grad=True)
    inner = SGD([w], learning_rate=schedule, momentum=0.9)
    w.grad = torch.ones(3)
    inner.step()  # alone, before it is wrapped
    opt = WrappedOptimizer(inner)
    for _ in range(3):
        opt.step()
    sd = opt.state_dict()
    assert (sd["iterations"], sd["wrapped_iterations"]) == (3, 4)
    w2 = torch.zeros(3, requires_grad=True)
    opt2 = WrappedOptimizer(SGD([w2], learning_rate=schedule, momentum=0.9))
    with pytest.raises(ValueError, match=r"state_dict\['wrapped_iterations'\] must be an int"):
        opt2.load_state_dict({**sd, "wrapped_iterations": -1})
    assert (opt2.iterations, opt2.wrapped.iterations) == (0, 0)  # nothing changed
    opt2.load_state_dict(sd)
    assert (opt2.iterations, opt2.wrapped.iterations) == (3, 4)
    with torch.no_grad():
        w2.copy_(w)
    w2.grad = torch.ones(3)
    opt.step()
    opt2.step()
    assert torch.equal(w2, w)  # the same rate (schedule(4)) and momentum


class _Counting(WrappedOptimizer):
    """A wrapper with state of its own (its ``"wrapper"`` entry): how many steps it saw."""

    def __init__(self, opt):
        super().__init__(opt)
        self.seen = 0

    def _after_inner_step(self):
        self.seen += 1

    def _wrapper_state_dict(self):
        return {"seen": self.seen}

    def _check_wrapper_state_dict(self, state):
        if not isinstance(state, dict) or set(state) != {"seen"}:
            raise ValueError(f"_Counting needs state_dict['wrapper'] = {{'seen': n}}, got {state}")

    def _load_wrapper_state_dict(self, state):
        self.seen = state["seen"]


def _chain(w, depth, schedule, stepped=False):
    """``depth`` wrappers (a ``_Counting`` one under a plain one, alternately) over the mesh
    SGD; ``stepped``: each level steps alone once before it is wrapped, so every level's count
    differs (innermost: ``depth + 1`` steps more than the outermost)."""
    from distoptim.dtensor import SGD

    opt = SGD([w], learning_rate=schedule, momentum=0.9)
    for level in range(depth + 1):
        if level:
            opt = (_Counting if level % 2 else WrappedOptimizer)(opt)
        if stepped:
            w.grad = torch.ones(3)
            opt.step()
    return opt


def _levels(opt):
    """Outermost first: each level's ``iterations`` (and a ``_Counting`` level's ``seen``)."""
    out = []
    while True:
        out.append((opt.iterations, getattr(opt, "seen", None)))
        if not isinstance(opt, WrappedOptimizer):
            return out
        opt = opt.wrapped


@pytest.mark.parametrize("depth", [2, 3])
def test_state_dict_keeps_every_step_count_of_a_wrapper_chain(depth):
    """However deep the mesh SGD sits, its own count (which its schedule reads) and every
    wrapper's count and own state come back on load; the resumed chain continues bit for bit."""

    def schedule(t):
        return 0.1 / (1 + t)

    w = torch.zeros(3, requires_grad=True)
    opt = _chain(w, depth, schedule, stepped=True)
    sd = opt.state_dict()
    w2 = torch.zeros(3, requires_grad=True)
    opt2 = _chain(w2, depth, schedule)
    assert _levels(opt)[-1][0] == depth + 1  # the mesh SGD's own count, the chain's largest
    opt2.load_state_dict(copy.deepcopy(sd))
    assert _levels(opt2) == _levels(opt)
    opt3 = _chain(torch.zeros(3, requires_grad=True), depth, schedule)
    fresh = _levels(opt3)
    deepest = "wrapped_" * depth + "iterations"
    with pytest.raises(ValueError, match=rf"state_dict\['{deepest}'\] must be an int >= 0"):
        opt3.load_state_dict({**sd, deepest: -1})
    assert _levels(opt3) == fresh  # a refusal changed nothing, at any level
    with torch.no_grad():
        w2.copy_(w)
    for _ in range(2):
        w.grad, w2.grad = torch.ones(3), torch.ones(3)
        opt.step()
        opt2.step()
    assert torch.equal(w2, w)  # the same rates (the schedule at the same step) and momentum


def test_step_closure_zero_grad_and_lr_scheduler():
    opt, (w, b, _), x = _setup(momentum=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    lrs = []
    for _ in range(5):
        opt.zero_grad()

        def closure():
            loss = _loss(w, b, x)
            loss.backward()
            return loss

        assert isinstance(opt.step(closure), torch.Tensor)
        lrs.append(opt.wrapped.param_groups[0]["lr"])
        sched.step()
    assert lrs == [0.1, 0.1, 0.05, 0.05, 0.025]
    assert opt.iterations == 5
    opt.zero_grad()
    assert w.grad is None


def test_add_param_group_reaches_wrapped():
    opt, _, _ = _setup()
    extra = torch.nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra], "lr": 1.0})
    assert len(opt.wrapped.param_groups) == 2 and opt.param_groups is opt.wrapped.param_groups


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda o, w, b, x: o.compute_gradients(x @ w + b), ValueError, "scalar"),
        (lambda o, w, b, x: o.compute_gradients(42), TypeError, "loss must be"),
        (lambda o, w, b, x: o.compute_gradients(_loss(w, b, x).detach()), ValueError, "grad"),
        (
            lambda o, w, b, x: o.compute_gradients(_loss(w, b, x), [w, "b"]),
            TypeError,
            r"var_list\[1\]",
        ),
        (lambda o, w, b, x: o.compute_gradients(_loss(w, b, x), w), TypeError, "single tensor"),
        (lambda o, w, b, x: o.apply_gradients([(torch.ones(3, 2),)]), TypeError, "pair"),
        (lambda o, w, b, x: o.apply_gradients([(torch.ones(2), w)]), ValueError, "shape"),
        (lambda o, w, b, x: o.apply_gradients([("g", w)]), TypeError, "grad must be"),
        (lambda o, w, b, x: o.apply_gradients([(None, w)]), ValueError, "No gradients"),
        (lambda o, w, b, x: o.apply_gradients([]), ValueError, "empty"),
        (lambda o, w, b, x: o.apply_gradients(torch.ones(2)), TypeError, "pairs"),
        (
            lambda o, w, b, x: o.apply_gradients(
                [(torch.ones(2), b), (torch.ones(1), torch.ones(1))]
            ),
            ValueError,
            "does not own",
        ),
        (
            lambda o, w, b, x: o.apply_gradients(
                [(torch.ones(2), b)], global_step=torch.tensor(1.0)
            ),
            TypeError,
            "global_step",
        ),
        (lambda o, w, b, x: WrappedOptimizer("sgd"), TypeError, "torch.optim.Optimizer"),
    ],
)
def test_bad_input_raises_and_mutates_nothing(call, exc, match):
    opt, (w, b, unused), x = _setup()
    before = [p.detach().clone() for p in (w, b, unused)]
    with pytest.raises(exc, match=match):
        call(opt, w, b, x)
    for p, p0 in zip((w, b, unused), before):
        assert torch.equal(p.detach(), p0)
    assert opt.iterations == 0 and not opt.wrapped.state
    assert all(p.grad is None for p in (w, b, unused))


def test_the_package_namespace_is_the_public_api_and_lazy():
    import subprocess
    import sys

    code = (
        "import sys, distoptim\n"
        "assert 'distoptim.agn' not in sys.modules, 'importing distoptim imported agn'\n"
        "from distoptim.cross_shard_sharding import elementwise\n"
        "assert distoptim.elementwise is elementwise\n"
        "names = [n for n in dir(distoptim) if not n.startswith('_')]\n"
        "assert set(distoptim.__all__) - {'__version__'} <= set(names), names\n"
        "print(distoptim.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    from distoptim._version import __version__

    assert out.stdout.strip() == __version__
