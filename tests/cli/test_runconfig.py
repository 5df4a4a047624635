"""cli.runconfig: a RunConfig refuses what no run can do, naming the field and what is allowed."""

from __future__ import annotations

import pytest

from distoptim.cli.runconfig import RunConfig

_BASE = dict(algo="sync", workers=2, communication_period=1, epochs=1, batch_size=4)


def _config(**change):
    return RunConfig(**{**_BASE, "optimizer": "adam", "lr": 0.001, "seed": 0, **change})


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"workers": 0}, ValueError, "workers must be an integer >= 1, got 0"),
        ({"epochs": True}, ValueError, "epochs must be a number > 0, got True"),
        ({"epochs": 0.0}, ValueError, "epochs must be a number > 0, got 0.0"),
        ({"seed": 2**32}, ValueError, "seed must be an integer in [0, 4294967295], got 4294967296"),
        ({"seed": -1}, ValueError, "seed must be an integer in [0, 4294967295], got -1"),
        ({"model": "rnn"}, ValueError, "unknown model 'rnn'"),
        ({"context": 0}, ValueError, "context must be an integer >= 1, got 0"),
        ({"wire": "topk:0"}, ValueError, "the density '0' is not a number in (0, 1]"),
        ({"eval_points": 2.0}, ValueError, "eval_points must be an integer >= 1, got 2.0"),
        ({"fragment_sync_delay": -1}, ValueError, "must be an integer >= 0, got -1"),
        ({"optimizer": "rmsprop"}, ValueError, "unknown optimizer 'rmsprop'"),
        ({"optimizer": "Adam"}, ValueError, "unknown optimizer 'Adam'"),
        ({"lr": float("nan")}, ValueError, "lr must be a finite number > 0"),
        ({"outer_momentum": 1.0}, ValueError, "outer_momentum must be in [0, 1), got 1.0"),
        ({"fragment_alpha": -0.1}, ValueError, "fragment_alpha must be in [0, 1], got -0.1"),
        ({"wire": "fp8"}, ValueError, "unknown wire 'fp8'"),
        ({"transport": "mpi"}, ValueError, "unknown transport 'mpi'"),
        ({"agn_rule": "keras"}, ValueError, "unknown agn_rule 'keras'"),
        ({"dylu": 1}, TypeError, "dylu must be True or False, got 1"),
        ({"stragglers": ((2, 3.0),)}, ValueError, "straggler 2 is not a worker"),
    ],
)
def test_a_bad_field_is_refused_by_name(change, error, message):
    with pytest.raises(error) as info:
        _config(**change)
    assert message in str(info.value)


def test_a_good_config_resolves_its_rules():
    cfg = _config(workers=4, communication_period=10, moving_rate="tf", wire="bf16")
    assert cfg.easgd_alpha == pytest.approx(0.9 / 40) and cfg.delayed_nesterov == 4
    lm = _config(model="gpt", epochs=0.05, wire="topk:0.02+int2", seed=2**32 - 1)
    assert lm.epochs == 0.05 and lm.wire == "topk:0.02+int2"
