"""Link emulation: the cost model, the environment variable, and the no-op default."""

from __future__ import annotations

import time

import pytest

from distoptim.comm import link


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv(link.ENV_VAR, raising=False)
    link.set_link(None)
    yield
    link.set_link(None)


def test_delay_model():
    lk = link.Link(latency_ms=5, mbps=100)
    assert lk.delay_s(0) == pytest.approx(0.005)
    assert lk.delay_s(12_500_000) == pytest.approx(0.005 + 1.0)  # 100 Mbit = 12.5 MB per second
    assert link.Link(latency_ms=0).delay_s(10**9) == 0.0


def test_env_round_trip_and_lazy_resolution(monkeypatch):
    assert link.Link.from_env(link.Link(2.5, 40).to_env()) == link.Link(2.5, 40)
    assert link.Link.from_env("3,") == link.Link(3.0, None)
    link._active = link._UNSET
    monkeypatch.setenv(link.ENV_VAR, "20,")
    assert link.get_link() == link.Link(20.0, None)
    t0 = time.perf_counter()
    link.transmit(1)
    assert time.perf_counter() - t0 >= 0.019


def test_default_is_no_link():
    link._active = link._UNSET
    assert link.get_link() is None
    link.transmit(10**12)  # returns at once: nothing to pay


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"latency_ms": -1}, "latency_ms"),
        ({"mbps": 0}, "mbps"),
        ({"latency_ms": float("nan")}, "finite"),
    ],
)
def test_bad_links(kwargs, match):
    with pytest.raises(ValueError, match=match):
        link.Link(**kwargs)
    with pytest.raises(TypeError):
        link.set_link("5,100")
    with pytest.raises(ValueError, match="LATENCY_MS"):
        link.Link.from_env("5")
