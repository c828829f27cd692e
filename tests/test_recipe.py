"""Recipe's `+float=SITE`: one site of a quantized scheme kept in float (the 16-bit fallback of a plan)."""

import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.schemes import recipe_weight_bytes, weight_bytes
from ffnquant.recipe import Recipe
from ffnquant.spec import FFNSpec


@pytest.mark.parametrize("text, slug", [
    ("w8a8@search+smooth+float=hidden", "w8a8-search.smooth0.5.float-hidden"),
    ("w4a16-g128+float=input", "w4a16-g128.float-input"),
    ("w8a8-dynamic-s8+rotate+float=input", "w8a8-dynamic-s8.rotate.float-input"),
], ids=["static-smooth-hidden", "w4-input", "dynamic-rotate-input"])
def test_float_site_round_trips_through_text_json_and_file_names(text, slug):
    r = Recipe.parse(text)
    assert Recipe.parse(str(r)) == r
    assert Recipe.from_dict(r.to_dict()) == r
    assert r.slug == slug
    assert r.plain().keep_float == r.keep_float  # plain() drops remedies, not the float site


def test_a_recipe_without_float_site_keeps_its_json():
    assert "keep_float" not in Recipe.parse("w8a8@search+smooth").to_dict()


@pytest.mark.parametrize("text, message", [
    ("fp32+float=hidden", "float already"),
    ("w8a8+float=gate", "float=input, float=hidden"),
    ("w8a8+float", "float=input, float=hidden"),
    ("w8a8+float=hidden+float=input", "given twice"),
], ids=["float-scheme", "unknown-site", "no-site", "twice"])
def test_bad_float_sites_say_what_is_valid(text, message):
    with pytest.raises(FFNQuantError, match=message):
        Recipe.parse(text)


@pytest.mark.parametrize("variant, text, weights, sites", [
    ("swiglu", "w8a8+float=hidden", ["w_up", "w_gate"], ["input"]),
    ("swiglu", "w8a8+float=input", ["w_down"], ["hidden"]),
    ("relu", "w4a16-g32+float=input", ["w_down"], []),
], ids=["swiglu-hidden", "swiglu-input", "relu-w4-input"])
def test_quantized_parts_leave_the_float_site_and_its_matrices_out(variant, text, weights, sites):
    assert Recipe.parse(text).quantized_parts(FFNSpec(variant, d_model=64)) == (weights, sites)


def test_bytes_count_the_float_matrices_at_16_bits():
    spec = FFNSpec("swiglu", d_model=64, d_ff=128)
    d_ff, d = 128, 64
    full = weight_bytes(spec, Recipe("w8a8").resolve())
    # w8a8: one int8 code per weight and a float32 scale per output channel
    down_int8 = d * d_ff + 4 * d
    assert recipe_weight_bytes(spec, Recipe.parse("w8a8+float=hidden")) == full - down_int8 + 2 * d * d_ff


def test_quantize_spec_leaves_the_float_site_untouched():
    from ffnquant.quantization import prepare, quantize_spec

    spec = FFNSpec("swiglu", d_model=64)
    prep = prepare(spec, "llm_like", calib_tokens=512, eval_tokens=256)
    full = quantize_spec(spec, Recipe.parse("w8a8"), prep, onnx=False, sensitivity=False)
    part = quantize_spec(spec, Recipe.parse("w8a8+float=hidden"), prep, onnx=False, sensitivity=False)
    q = part.qmodel
    assert q.quantized_weights == ("w_up", "w_gate") and q.quantized_sites == ("input",)
    assert torch.equal(q.model.w_down.weight, prep.model.w_down.weight)
    assert not torch.equal(q.model.w_up.weight, prep.model.w_up.weight)
    # the float site adds no error: quantizing fewer parts cannot lose accuracy on the same calibration
    assert part.accuracy.sqnr_db > full.accuracy.sqnr_db


@pytest.mark.parametrize("text", ["w8a8+float=hidden", "w8a8+float=input", "w4a16-g32+float=hidden"],
                         ids=["qdq-hidden", "qdq-input", "nbits-hidden"])
def test_the_onnx_artifact_of_a_float_site_recipe_computes_the_torch_reference(text, tmp_path):
    from ffnquant.quantization import quantize_spec
    from onnx_checks import graph_db

    spec = FFNSpec("swiglu", d_model=64)
    res = quantize_spec(spec, Recipe.parse(text), source="llm_like", calib_tokens=512, eval_tokens=256,
                        out_artifacts=tmp_path, baseline=False, sensitivity=False)
    assert res.artifact["path"].endswith(Recipe.parse(text).slug + ".onnx")
    # ORT's integer kernels and the float reference differ by rounding only (the same grids)
    assert abs(graph_db(res.artifact) - res.accuracy.sqnr_db) < 1.0


@pytest.mark.parametrize("text, reads", [
    ("fp32", False), ("w8a16", False), ("w4a16-g128", False), ("w8a8-dynamic-s8", False),
    ("w8a8-dynamic-s8+rotate", False), ("w8a8-dynamic-s8+float=hidden", False),
    ("w8a8", True), ("w8a8@search", True), ("w4a16-g128-gptq", True), ("w4a16-g128-awq", True),
    ("w8a16+smooth", True),
])
def test_reads_calibration_says_whether_the_text_changes_the_quantized_model(text, reads):
    """Static ranges, second-order statistics and smoothing read the calibration text; rounding and per-token
    activations (and a fixed rotation) do not."""
    assert Recipe.parse(text).reads_calibration is reads
