"""Schemes: presets round-trip through JSON, validation errors name the problem, group sizes are checked against the FFN."""

import json

import pytest

from ffnquant.errors import FFNQuantError
from ffnquant.schemes import (
    PRESETS,
    ActDType,
    ActMode,
    Compute,
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
    for name in ("fp32", "fp16", "bf16", "w8a16", "w8a8", "w8a8-s8", "w8a8-dynamic", "w8a8-dynamic-s8", "w4a16-g32",
                 "w4a16-g64", "w4a16-g128", "w4a16-g128-asym", "w4a16-g128-hqq", "w4a16-g128-gptq", "nf4", "fp4",
                 "fp8-e4m3", "fp8-e4m3-pc", "fp8-e4m3-dynamic", "llm-int8", "llm-int8-t0"):
        assert name in PRESETS


def test_w8a8_defaults_are_uint8_asymmetric_static_per_tensor():
    s = get_scheme("w8a8")
    assert (s.act_dtype, s.act_mode, s.act_symmetric) == (ActDType.UINT8, ActMode.STATIC, False)
    assert s.weight_granularity is Granularity.PER_CHANNEL and s.weight_symmetric
    s8 = get_scheme("w8a8-s8")
    assert s8.act_dtype is ActDType.INT8 and s8.act_symmetric
    assert get_scheme("w8a8-dynamic").act_mode is ActMode.DYNAMIC


def test_unknown_scheme_lists_presets():
    with pytest.raises(FFNQuantError, match=r"unknown scheme 'w9a9'; valid: fp32, fp16, bf16, w8a16, w8a8"):
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
        pytest.param(dict(act_dtype="bf16", act_mode="dynamic"), "needs quantized activations", id="bf16-act-mode"),
        pytest.param(dict(outlier_threshold=6.0), "LLM.int8's column split", id="threshold-weight-only"),
        pytest.param(dict(act_dtype="uint8", act_mode="dynamic", outlier_threshold=6.0), "LLM.int8's column split",
                     id="threshold-uint8"),
        pytest.param(dict(act_dtype="int8", act_mode="dynamic", outlier_threshold=-1.0), "finite number >= 0",
                     id="threshold-negative"),
        pytest.param(dict(act_dtype="int8", act_mode="dynamic", outlier_threshold=True), "finite number >= 0",
                     id="threshold-bool"),
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
    "spec, scheme",
    [
        pytest.param(FFNSpec("swiglu", d_model=96), "w4a16-g128", id="d_model-96-g128"),
        pytest.param(FFNSpec("relu", d_model=64, d_ff=200), "w4a16-g64", id="d_ff-200-g64"),
        pytest.param(FFNSpec("swiglu", d_model=576, d_ff=1536), "w4a16-g128", id="smollm-135m"),
        pytest.param(FFNSpec("swiglu", d_model=96, d_ff=160), "w4a16-g64-gptq", id="gptq"),
        pytest.param(FFNSpec("relu", d_model=96), "nf4", id="nf4"),
        pytest.param(FFNSpec("relu", d_model=48, d_ff=96), "w4a16-g128", id="group-wider-than-d_model"),
    ],
)
def test_any_group_size_fits_any_width(spec, scheme):
    """A group that does not divide a width pads it to whole groups (it used to be refused:
    "group size 128 does not divide d_model=576"); a group wider than K is one padded group."""
    check_scheme_fits(get_scheme(scheme), spec)


def test_group_size_fits_default_gated_width():
    check_scheme_fits(get_scheme("w4a16-g128"), FFNSpec("swiglu", d_model=512))  # d_ff 1408 = 11 x 128


def test_dynamic_presets_say_which_int8_they_are():
    """w8a8-dynamic is uint8 asymmetric per token (onnxruntime's convention); w8a8-dynamic-s8 is the
    symmetric int8 per token that GPU int8 GEMMs (torch._int_mm) take."""
    u8, s8 = get_scheme("w8a8-dynamic"), get_scheme("w8a8-dynamic-s8")
    assert (u8.act_dtype, u8.act_mode, u8.act_symmetric) == (ActDType.UINT8, ActMode.DYNAMIC, False)
    assert (s8.act_dtype, s8.act_mode, s8.act_symmetric) == (ActDType.INT8, ActMode.DYNAMIC, True)
    for s in (u8, s8):
        assert (s.weight_dtype, s.weight_granularity, s.weight_symmetric) == (WeightDType.INT8, Granularity.PER_CHANNEL, True)
    assert "uint8 asymmetric" in u8.description and "int8 symmetric" in s8.description


def test_runtime_only_presets():
    bf16 = get_scheme("bf16")
    assert bf16.weight_dtype.is_float and bf16.act_dtype is ActDType.BF16 and bf16.compute is Compute.FP16
    llm, t0 = get_scheme("llm-int8"), get_scheme("llm-int8-t0")
    assert (llm.outlier_threshold, t0.outlier_threshold) == (6.0, 0.0)
    # threshold 0 is w8a8-dynamic-s8's math (bitsandbytes quantizes from fp16 inputs); 6.0 is not
    assert t0.with_(name="w8a8-dynamic-s8", outlier_threshold=None) == get_scheme("w8a8-dynamic-s8")
    assert "|x| > 6" in llm.description and "no outlier split" in t0.description
    assert get_scheme("w8a8-dynamic-s8").outlier_threshold is None


@pytest.mark.parametrize("name, why", [pytest.param("llm-int8", "outlier split", id="llm-int8"),
                                       pytest.param("bf16", "no bf16 rounding", id="bf16")])
def test_schemes_without_a_fake_quant_reference_are_refused_by_ffnquant(name, why):
    scheme = get_scheme(name)
    assert why in scheme.no_reference_reason
    with pytest.raises(FFNQuantError, match=why):
        check_scheme_fits(scheme, FFNSpec("relu", d_model=64))


@pytest.mark.parametrize("name", ["fp32", "w8a8-dynamic-s8", "llm-int8-t0", "w4a16-g32-asym"], ids=str)
def test_schemes_with_a_reference(name):
    assert get_scheme(name).no_reference_reason is None
    check_scheme_fits(get_scheme(name), FFNSpec("relu", d_model=64))


@pytest.mark.parametrize(
    "name, compute",
    [("fp32", "fp32"), ("fp16", "fp16"), ("w8a16", "fp16"), ("w4a16-g128", "fp16"), ("nf4", "fp16"), ("w8a8", "int8"),
     ("w8a8-dynamic-s8", "int8"), ("llm-int8", "int8"), ("fp8-e4m3", "fp8"), ("fp8-e4m3-dynamic", "fp8")],
    ids=lambda v: str(v),
)
def test_compute_kind_follows_the_activations(name, compute):
    assert get_scheme(name).compute.value == compute


def test_runtime_formats_are_views_of_the_presets():
    """One registry: every runtime format is a preset of the same name, with the preset's facts."""
    from ffnquant.runtimes import FORMATS, get_format

    assert list(FORMATS) == preset_names()
    for name, fmt in FORMATS.items():
        scheme = get_scheme(name)
        assert fmt.scheme == scheme and fmt.description == scheme.description and fmt.compute is scheme.compute
        assert fmt.group_size == scheme.group_size and "scheme" not in fmt.to_dict()
    assert get_format("w8a8-dynamic").activation == "uint8 dynamic"
    assert get_format("w8a8-dynamic-s8").activation == "int8 dynamic"
    assert get_format("llm-int8").activation == "int8 dynamic + fp16 outliers"
