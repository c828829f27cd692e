"""Schemes: presets round-trip through JSON, validation errors name the problem, group sizes are checked against the FFN."""

import json

import pytest

from ffnquant.errors import FFNQuantError
from ffnquant.schemes import (
    PRESETS,
    ActDType,
    ActMode,
    Granularity,
    Method,
    Scheme,
    WeightDType,
    check_scheme_fits,
    get_scheme,
    preset_names,
)
from ffnquant.spec import FFNSpec


@pytest.mark.parametrize("name", preset_names(), ids=str)
def test_presets_round_trip_through_json(name):
    scheme = get_scheme(name)
    assert scheme.name == name
    assert Scheme.from_dict(json.loads(json.dumps(scheme.to_dict()))) == scheme


def test_required_presets_exist():
    for name in ("fp32", "fp16", "w8a16", "w8a8", "w8a8-s8", "w8a8-dynamic", "w4a16-g32", "w4a16-g64", "w4a16-g128",
                 "w4a16-g128-asym", "w4a16-g128-hqq", "w4a16-g128-gptq", "nf4", "fp4", "fp8-e4m3", "fp8-e4m3-pc"):
        assert name in PRESETS


def test_w8a8_defaults_are_uint8_asymmetric_static_per_tensor():
    s = get_scheme("w8a8")
    assert (s.act_dtype, s.act_mode, s.act_symmetric) == (ActDType.UINT8, ActMode.STATIC, False)
    assert s.weight_granularity is Granularity.PER_CHANNEL and s.weight_symmetric
    s8 = get_scheme("w8a8-s8")
    assert s8.act_dtype is ActDType.INT8 and s8.act_symmetric
    assert get_scheme("w8a8-dynamic").act_mode is ActMode.DYNAMIC


def test_unknown_scheme_lists_presets():
    with pytest.raises(FFNQuantError, match=r"unknown scheme 'w9a9'; valid: fp32, fp16, w8a16, w8a8"):
        get_scheme("w9a9")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(weight_dtype="int4", weight_granularity="per_group"), "group_size", id="group-size-missing"),
        pytest.param(dict(weight_dtype="nf4", weight_granularity="per_channel"), "block-wise absmax", id="nf4-per-channel"),
        pytest.param(dict(weight_dtype="int4", weight_granularity="per_group", group_size=32, method="hqq"), "asymmetric", id="hqq-symmetric"),
        pytest.param(dict(act_mode="static"), "needs quantized activations", id="mode-without-act-dtype"),
        pytest.param(dict(weight_dtype="int9"), "unknown weight dtype 'int9'; valid: fp32", id="bad-dtype"),
        pytest.param(dict(act_dtype="uint8", calibrator="median"), "unknown calibrator 'median'", id="bad-calibrator"),
        pytest.param(dict(weight_dtype="fp8_e4m3", weight_granularity="per_group", group_size=32), "per_tensor or per_channel", id="fp8-groups"),
        pytest.param(dict(version=7), "version", id="future-version"),
    ],
)
def test_invalid_schemes_are_refused(kwargs, message):
    with pytest.raises(FFNQuantError, match=message):
        Scheme("bad", **kwargs)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(FFNQuantError, match="unknown Scheme field"):
        Scheme.from_dict({**get_scheme("w8a8").to_dict(), "magic": 1})


def test_enums_parse_from_strings():
    s = Scheme("x", weight_dtype="INT4", weight_granularity="per_group", group_size=64, method="GPTQ")
    assert s.weight_dtype is WeightDType.INT4 and s.method is Method.GPTQ


@pytest.mark.parametrize(
    "spec, scheme, which",
    [
        pytest.param(FFNSpec("swiglu", d_model=96), "w4a16-g128", "d_model=96", id="d_model"),
        pytest.param(FFNSpec("relu", d_model=64, d_ff=200), "w4a16-g64", "d_ff=200", id="d_ff"),
    ],
)
def test_group_size_must_divide_both_widths(spec, scheme, which):
    with pytest.raises(FFNQuantError, match=which):
        check_scheme_fits(get_scheme(scheme), spec)


def test_group_size_fits_default_gated_width():
    check_scheme_fits(get_scheme("w4a16-g128"), FFNSpec("swiglu", d_model=512))  # d_ff 1408 = 11 x 128
