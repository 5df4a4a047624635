"""Gradients as bucket views: aliases, presence tracking, zeroing, settling (one process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.grad_views import GradViews


def _model() -> tuple[nn.Module, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, list(model.parameters())


def _loss(model: nn.Module) -> torch.Tensor:
    return F.mse_loss(model(torch.ones(5, 3)), torch.zeros(5, 2))


def test_aliases_share_the_bucket_memory_but_not_its_version_counter() -> None:
    _, params = _model()
    plan = BucketPlan(params, cap_bytes=1 << 20)
    (bucket,) = plan.buckets
    aliases = bucket.grad_aliases()
    assert bucket.grad_aliases() is aliases  # made once
    buffer = bucket.persistent_buffer()
    for alias, view in zip(aliases, bucket.views(buffer)):
        assert alias.data_ptr() == view.data_ptr() and alias.shape == view.shape
        assert alias._base is None  # not a view: its own version counter
    before = [a._version for a in aliases]
    buffer.mul_(2.0)  # what a reduction does: no alias counts as written
    assert [a._version for a in aliases] == before
    aliases[0].add_(1.0)
    assert aliases[0]._version == before[0] + 1 and aliases[1]._version == before[1]


def test_pack_copies_nothing_for_gradients_already_in_their_slots() -> None:
    _, params = _model()
    plan = BucketPlan(params, cap_bytes=1 << 20, trailer=2)
    (bucket,) = plan.buckets
    buffer = bucket.persistent_buffer()
    aliases = bucket.grad_aliases()
    for alias in aliases:
        alias.fill_(3.0)
    foreign = torch.full_like(aliases[1], 7.0)
    grads = [aliases[0], foreign, None, aliases[3]]
    bucket.pack(buffer, grads)
    views = bucket.views(buffer)
    assert views[0].eq(3.0).all() and views[1].eq(7.0).all() and views[2].eq(0.0).all()
    assert bucket.present(buffer) == [True, True, False, True]


def test_presence_follows_writes_since_the_last_zeroing() -> None:
    model, params = _model()
    plan = BucketPlan(params, cap_bytes=1 << 20)
    views = GradViews(plan)
    views.zero(set_to_none=True)
    assert all(p.grad is a for p, a in zip(plan.params, views.aliases))
    assert views.present_grads() == [None] * 4  # zeroed slots are absent, not zero gradients
    model[2](torch.ones(1, 4)).sum().backward()  # reaches the last layer only
    present = [g is not None for g in views.present_grads()]
    assert present == [False, False, True, True]
    assert all(p.grad is a for p, a in zip(plan.params, views.aliases))  # accumulated in place
    views.zero(set_to_none=False)  # torch keeps these as zeros: still present
    assert [g is not None for g in views.present_grads()] == present
    assert all(a.eq(0).all() for a in views.aliases)
    views.zero(set_to_none=True)
    assert views.present_grads() == [None] * 4
    plan.params[0].grad = torch.ones_like(plan.params[0])  # a user's own tensor: present
    assert views.foreign() == [0] and views.present_grads()[0] is plan.params[0].grad
    plan.params[1].grad = None
    assert views.present_grads()[1] is None


def test_settle_rescales_to_the_replica_mean_and_take_over_moves_the_slots() -> None:
    model, params = _model()
    plan = BucketPlan(params, cap_bytes=1 << 20)
    views = GradViews(plan)
    views.zero(set_to_none=True)
    _loss(model).backward()
    local = [a.clone() for a in views.aliases]
    # an in-place MEAN round of n = 2 replicas with 2 passes divides by d = 4: slots hold R;
    # settle makes them S = R * d / n, here R * 2
    for a in views.aliases:
        a.data.div_(4.0)
    views.settle([True, True, False, True], factor=2.0)
    assert all(torch.equal(a, g / 2) for a, g in zip(views.aliases, local))
    assert [g is not None for g in views.present_grads()] == [True, True, False, True]
    # a new plan (other order, two buckets): values and presence carried over
    moved = BucketPlan(params, cap_bytes=4 * 4 * 3, order=[0, 1, 2, 3])
    new = GradViews(moved)
    new.take_over(views)
    assert all(p.grad is a for p, a in zip(moved.params, new.aliases))
    assert all(torch.equal(a, g / 2) for a, g in zip(new.aliases, local))
    assert [g is not None for g in new.present_grads()] == [True, True, False, True]
