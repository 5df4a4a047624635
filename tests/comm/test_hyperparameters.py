"""An optimizer's hyperparameters as plain data: fingerprints that see every change, and
differences that name every replica's value."""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from distoptim.comm.hyperparameters import describe_optimizer, differences, fingerprint


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]


def _sgd(params, **kw) -> torch.optim.SGD:
    return torch.optim.SGD(params, **{"lr": 0.7, "momentum": 0.9, "nesterov": True, **kw})


def test_equal_optimizers_have_equal_fingerprints_and_any_change_shows():
    ps = _params()
    base = fingerprint(describe_optimizer(_sgd(ps), ps))
    assert fingerprint(describe_optimizer(_sgd(ps), ps)) == base
    changed = [
        _sgd(ps, lr=0.5),
        _sgd(ps, momentum=0.8),
        _sgd(ps, nesterov=False, momentum=0.9),
        _sgd(ps, weight_decay=1e-4),
        torch.optim.SGD(
            [{"params": ps[:1]}, {"params": ps[1:]}], lr=0.7, momentum=0.9, nesterov=True
        ),
        torch.optim.SGD(ps[::-1], lr=0.7, momentum=0.9, nesterov=True),  # other positions
        torch.optim.Adam(ps, lr=0.7),
    ]
    prints = {fingerprint(describe_optimizer(opt, ps)) for opt in changed}
    assert base not in prints and len(prints) == len(changed)


def test_implementation_flags_are_not_compared():
    ps = _params()
    assert fingerprint(describe_optimizer(_sgd(ps, foreach=True), ps)) == fingerprint(
        describe_optimizer(_sgd(ps, foreach=False), ps)
    )


def test_values_become_plain_exact_data():
    ps = _params()
    opt = torch.optim.Adam(ps, lr=torch.tensor(0.001), betas=(0.9, 0.999))
    opt.param_groups[0]["custom"] = (np.float32(0.5), np.int64(3), math.nan, object())
    desc = describe_optimizer(opt, ps)
    text = json.dumps(desc)  # JSON-able
    group = json.loads(text)["groups"][0]
    assert group["betas"] == [0.9, 0.999]
    assert group["lr"] == {"tensor": 0.0010000000474974513, "dtype": "torch.float32"}
    assert group["custom"] == [0.5, 3, "nan", "<builtins.object>"]  # no addresses
    assert group["params"].startswith("2 #")


def test_differences_name_every_replicas_value():
    ps = _params()
    a = {"outer optimizer": describe_optimizer(_sgd(ps), ps), "algorithm": "DiLoCo"}
    b = {"outer optimizer": describe_optimizer(_sgd(ps, lr=0.5), ps), "algorithm": "DiLoCo"}
    c = {"outer optimizer": describe_optimizer(_sgd(ps), ps), "algorithm": "LocalSGD"}
    lines = differences([a, b, c], ["rank 0", "rank 1", "rank 2"])
    assert lines == [
        "outer optimizer: group 0: lr: rank 0 0.7, rank 1 0.5, rank 2 0.7",
        'algorithm: rank 0 "DiLoCo", rank 1 "DiLoCo", rank 2 "LocalSGD"',
    ]
    assert differences([a, a], ["rank 0", "rank 1"]) == []
    many = [{"x": {str(i): 0 for i in range(12)}}, {"x": {str(i): 1 for i in range(11)}}]
    lines = differences(many, ["rank 0", "rank 1"], limit=3)
    assert lines[:1] == ["x: 0: rank 0 0, rank 1 1"] and lines[-1] == "... and 9 more differences"
    assert "x: 11: rank 0 0, rank 1 (none)" not in lines  # beyond the limit
