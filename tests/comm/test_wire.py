"""The wire registry: one spelling, the grammar, the scheme each format declares, the casts."""

from __future__ import annotations

import pytest
import torch

from distoptim.comm.averaging import SumMean
from distoptim.comm.channel import GroupChannel
from distoptim.comm.compression import WireFormat
from distoptim.comm.gather import GatheredMean
from distoptim.comm.quantize import QuantizedMean
from distoptim.comm.stats import CommStats
from distoptim.comm.wire import NAMES, parse_allreduce, parse_wire


@pytest.mark.parametrize(
    ("spec", "name", "scheme"),
    [
        ("fp32", "fp32", "all-reduce"),
        ("FP16", "fp16", "two-phase"),
        ("bf16", "bf16", "two-phase"),
        ("Int8", "int8", "two-phase"),
        ("int4", "int4", "two-phase"),
        ("INT2", "int2", "two-phase"),
        ("topk:0.02", "topk:0.02", "gather"),
        ("TopK:0.020+INT2", "topk:0.02+int2", "gather"),
        ("topk:1", "topk:1.0", "gather"),
        ("topk:1e-2+fp32", "topk:0.01", "gather"),  # fp32 values are the default
        ("topk:0.5+bf16", "topk:0.5+bf16", "gather"),
    ],
)
def test_spellings_and_schemes(spec, name, scheme):
    fmt = parse_wire(spec)
    assert (fmt.name, fmt.scheme) == (name, scheme)
    assert parse_wire(fmt.name).name == name  # the canonical name parses to itself
    assert fmt.lossy == (name != "fp32")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("fp8", "unknown wire 'fp8'"),
        ("", "unknown wire ''"),
        ("topk", "unknown wire 'topk'"),
        ("topk:", "density ''"),
        ("topk:0", r"density '0' is not a number in \(0, 1\]"),
        ("topk:1.5", "density '1.5'"),
        ("topk:nan", "density 'nan'"),
        ("topk:-0.1", "density '-0.1'"),
        ("topk:0.1+int3", "values' format 'int3'"),
        ("topk:0.1+topk:0.1", "values' format 'topk:0.1'"),
        ("int8+topk:0.1", "unknown wire"),
    ],
)
def test_bad_spellings_list_the_grammar(spec, says):
    with pytest.raises(ValueError, match=says) as info:
        parse_wire(spec)
    assert "'topk:D+V'" in str(info.value) and "'int2'" in str(info.value)


def test_a_wire_must_be_a_string():
    with pytest.raises(TypeError, match="wire must be a str"):
        parse_wire(8)
    with pytest.raises(TypeError, match="wire must be a str"):
        parse_wire(None)


def test_each_format_builds_the_scheme_it_declares():
    stats = CommStats()
    schemes = {"all-reduce": SumMean, "two-phase": QuantizedMean, "gather": GatheredMean}
    for spec in (*NAMES, "topk:0.1", "topk:0.1+int2"):
        fmt = parse_wire(spec)
        assert isinstance(fmt.mean(GroupChannel(None, 2), stats, True), schemes[fmt.scheme])
        # a group of one: nothing travels and nothing is encoded, whatever the format
        assert isinstance(fmt.mean(GroupChannel(None, 1), stats, True), SumMean)


def test_the_casts_that_ride_a_plain_all_reduce():
    assert parse_allreduce(None) == parse_allreduce("FP32") == WireFormat("fp32", None)
    assert parse_allreduce("fp16").dtype == torch.float16
    assert parse_allreduce("bf16") is parse_wire("bf16").allreduce
    for spec in ("int8", "int2", "topk:0.1"):
        with pytest.raises(ValueError, match="cannot ride a plain SUM all-reduce"):
            parse_allreduce(spec)
    with pytest.raises(ValueError, match="unknown wire"):
        parse_allreduce("fp8")
    with pytest.raises(TypeError, match="compression must be None"):
        parse_allreduce(torch.float16)
    # the 0.2.0 spelling of the synchronous optimizer's compression= is unchanged
    assert WireFormat.parse(None) == WireFormat(None, None)
    assert WireFormat.parse("BF16") == parse_allreduce("bf16")
    with pytest.raises(ValueError, match="allowed values are None, 'fp16', 'bf16'"):
        WireFormat.parse("int8")


def test_the_fixed_names_of_0_2_0_are_still_importable():
    from distoptim.comm.quantize import WIRES

    assert WIRES == NAMES and {"fp32", "bf16", "int8"} <= set(WIRES)
