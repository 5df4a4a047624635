"""distoptim.checks: every argument check accepts what it documents and names what it refuses."""

from __future__ import annotations

import math
import numbers
import pathlib

import numpy as np
import pytest

from distoptim import checks


def test_check_int_and_optional_int():
    assert checks.check_int("n", np.int64(3), 1) == 3
    for bad in (0, True, 2.0, "3", None):
        with pytest.raises(ValueError, match=r"n must be an int >= 1"):
            checks.check_int("n", bad, 1)
    assert checks.check_optional_int("k", None, 1) is None
    assert checks.check_optional_int("k", 5, 1) == 5
    with pytest.raises(ValueError, match=r"k must be None or an int >= 1, got 0"):
        checks.check_optional_int("k", 0, 1)


def test_check_bool_refuses_truthy_non_bools():
    assert checks.check_bool("flag", False) is False
    for bad in (0, 1, np.bool_(True), "yes", None):
        with pytest.raises(TypeError, match=r"flag must be True or False"):
            checks.check_bool("flag", bad)


def test_check_str_and_choice():
    assert checks.check_str("name", "x") == "x"
    with pytest.raises(TypeError, match=r"name must be a str, got int"):
        checks.check_str("name", 3)
    assert checks.check_choice("wire", "BF16", ("fp32", "bf16")) == "bf16"
    with pytest.raises(ValueError, match=r"unknown wire 'BF16': allowed values are 'bf16'"):
        checks.check_choice("wire", "BF16", ("bf16",), fold_case=False)
    with pytest.raises(ValueError, match=r"allowed values are 'fp32', 'bf16'"):
        checks.check_choice("wire", "int3", ("fp32", "bf16"))
    with pytest.raises(TypeError, match=r"wire must be one of 'fp32', 'bf16', got int 3"):
        checks.check_choice("wire", 3, ("fp32", "bf16"))


@pytest.mark.parametrize(
    ("kwargs", "good", "bad", "words"),
    [
        ({"low": 0.0, "high": 1.0}, [0, 0.5, 1], [-0.1, 1.1], r"in \[0, 1\]"),
        ({"low": 0.0, "low_open": True}, [1e-9, 5], [0, -1], r"> 0"),
        ({"high": 2.0, "high_open": True}, [1.9, -5], [2, 3], r"< 2"),
        ({}, [-1e300, 7], [], r"a finite number, got"),
    ],
)
def test_check_real_intervals(kwargs, good, bad, words):
    for v in good:
        assert checks.check_real("x", v, **kwargs) == float(v)
    for v in [*bad, math.nan, math.inf, True, "1", None]:
        with pytest.raises(ValueError, match=words if v in bad else r"x must be a finite number"):
            checks.check_real("x", v, **kwargs)


def test_check_seconds_and_path():
    assert checks.check_seconds("t", 2) == 2.0
    assert checks.check_seconds("t", 0, allow_zero=True) == 0.0
    with pytest.raises(ValueError, match=r"t must be a finite number > 0 \(seconds\)"):
        checks.check_seconds("t", 0)
    with pytest.raises(ValueError, match=r"seconds"):
        checks.check_seconds("t", False, allow_zero=True)
    # where zero is allowed, the message says so
    with pytest.raises(ValueError, match=r"t must be a finite number >= 0 \(seconds\), got -1"):
        checks.check_seconds("t", -1, allow_zero=True)
    assert checks.check_path("p", pathlib.Path("/tmp/x")) == "/tmp/x"
    assert checks.check_path("p", None, optional=True) is None
    with pytest.raises(TypeError, match=r"p must be a path \(str or os.PathLike\) or None"):
        checks.check_path("p", 3, optional=True)


def test_check_type_names_what_is_allowed_and_refuses_bools_as_numbers():
    assert checks.check_type("n", np.float32(0.5), numbers.Real, "a number") == np.float32(0.5)
    assert checks.check_type("m", None, dict, "a dict", optional=True) is None
    assert checks.check_type("flag", True, (bool, int), "a bool or an int") is True
    with pytest.raises(TypeError, match=r"^mesh must be a DeviceMesh or None, got str$"):
        checks.check_type("mesh", "cpu", dict, "a DeviceMesh", optional=True)
    for bad in (True, "1", None, [1.0]):
        with pytest.raises(TypeError, match=r"^rate must be a number in \[0, 1\], got "):
            checks.check_type("rate", bad, numbers.Real, "a number in [0, 1]")
