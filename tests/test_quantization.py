"""Torch reference numerics: SQNR floors per variant x scheme and variant x calibrator, ranges, sensitivity, errors."""

import math

import pytest
import torch

from ffnquant import FFNSpec, Variant, build
from ffnquant.numerics.accuracy import accuracy_of, cosine, rel_l2, sqnr_db
from ffnquant.data import gaussian_tokens
from ffnquant.errors import FFNQuantError
from ffnquant.methods.fakequant import quantize_model, search_calibrators
from ffnquant.quantization import prepare, quantize_spec, sensitivity
from ffnquant.recipe import Recipe

D = 64


@pytest.fixture(scope="module")
def preps():
    """One Gaussian calibration per variant, made on first use and shared by this module's tests only
    (a fresh dict per module run, so no result depends on which test ran first)."""
    made = {}

    def get(variant):
        variant = Variant(variant)
        if variant not in made:
            made[variant] = prepare(FFNSpec(variant, d_model=D), "gaussian", 1024, 512)
        return made[variant]

    return get


# Floors from the quantization math, with margin (random N(0, 1/fan_in) weights, Gaussian tokens):
# - int8 symmetric per-channel weights: ~42 dB per matrix (10 log10(12 * 127^2 / 3.4^2)); three
#   matrices' errors add and the gate product compounds them: >= 35 dB at the output.
# - uint8 static activations: the gated hidden's crest factor (absmax/std ~ 20) leaves
#   ~27 dB for per-tensor 8-bit (10 log10(12 * 255^2 / 40^2)): >= 22 dB.
# - entropy (KL) clips heavy tails hard (known TensorRT behaviour): >= 8 dB, still far from broken (0 dB).
# - int4 g32 / nf4: ~20-22 dB per matrix, three matrices and the product: >= 13 dB.
# - fp8 e4m3: 3 mantissa bits, ~31 dB per tensor, four quantized operands: >= 20 dB.
SCHEME_FLOORS = {"w8a16": 35.0, "w8a8-dynamic": 30.0, "w4a16-g32": 13.0, "nf4": 13.0, "fp8-e4m3": 20.0, "fp16": 60.0}
CALIBRATOR_FLOORS = {"minmax": 22.0, "percentile": 22.0, "mse": 22.0, "auto": 22.0, "entropy": 8.0}


@pytest.mark.parametrize("variant", list(Variant), ids=str)
@pytest.mark.parametrize("scheme", SCHEME_FLOORS, ids=str)
def test_sqnr_floor_per_variant_and_scheme(variant, scheme, preps):
    r = quantize_spec(FFNSpec(variant, d_model=D), scheme, prepared=preps(variant), onnx=False, sensitivity=False)
    assert r.accuracy.sqnr_db >= SCHEME_FLOORS[scheme]
    assert r.accuracy.sqnr_db < 200  # something was quantized


@pytest.mark.parametrize("variant", list(Variant), ids=str)
@pytest.mark.parametrize("calibrator", CALIBRATOR_FLOORS, ids=str)
def test_w8a8_sqnr_floor_per_variant_and_calibrator(variant, calibrator, preps):
    r = quantize_spec(FFNSpec(variant, d_model=D), Recipe("w8a8", calibrator), prepared=preps(variant), onnx=False,
                      sensitivity=False)
    assert r.accuracy.sqnr_db >= CALIBRATOR_FLOORS[calibrator]
    assert set(r.ranges) == {"input", "hidden"}
    for site, rng in r.ranges.items():
        assert rng.observed_min <= rng.lo <= rng.hi <= rng.observed_max
        assert rng.scale > 0 and 0 <= rng.zero_point <= 255
        if calibrator != "auto":
            assert rng.calibrator.split(":")[0] == calibrator


def test_relu_hidden_gets_a_one_sided_range(preps):
    r = quantize_spec(FFNSpec("relu", d_model=D), "w8a8@mse", prepared=preps(Variant.RELU), onnx=False, sensitivity=False)
    assert r.ranges["hidden"].lo == 0.0 and r.ranges["hidden"].zero_point == 0


def test_sensitivity_names_every_quantized_piece_and_each_is_better_than_all_together(preps):
    r = quantize_spec(FFNSpec("swiglu", d_model=D), "w8a8@mse", prepared=preps(Variant.SWIGLU), onnx=False)
    assert set(r.sensitivity) == {"w_up", "w_gate", "w_down", "input", "hidden"}
    assert all(v > r.accuracy.sqnr_db for v in r.sensitivity.values())
    # the public function gives the same numbers from the prepared calibration and the quantized FFN
    assert sensitivity(preps(Variant.SWIGLU), r.qmodel) == r.sensitivity


def test_sensitivity_of_a_gptq_recipe_uses_the_input_hessians(preps):
    """GPTQ weights need the calibration's Hessians: quantizing one weight alone without them (what the
    run's own per-site sensitivity did) fails; `sensitivity` takes them from the prepared calibration."""
    prep = preps(Variant.SWIGLU)
    r = quantize_spec(prep.spec, "w4a16-g32-gptq", prepared=prep, onnx=False, sensitivity=False)
    with pytest.raises(FFNQuantError, match="Hessians"):  # the old path: no hessians
        quantize_model(prep.model, r.qmodel.scheme, weights=["w_up"], sites=[])
    sens = sensitivity(prep, r.qmodel)
    assert set(sens) == {"w_up", "w_gate", "w_down"}
    assert all(math.isfinite(v) and r.accuracy.sqnr_db < v < 200 for v in sens.values())
    assert sensitivity(prep, r.qmodel, prep.hessians()) == sens


def test_gptq_beats_rtn_at_the_output():
    # on LLM-like inputs (a few large channels) the Hessian is far from isotropic: GPTQ's case
    spec = FFNSpec("swiglu", d_model=D)
    prep = prepare(spec, "llm_like", 1024, 512)
    rtn = quantize_spec(spec, "w4a16-g32", prepared=prep, onnx=False, sensitivity=False)
    gptq = quantize_spec(spec, "w4a16-g32-gptq", prepared=prep, onnx=False, sensitivity=False)
    assert gptq.accuracy.sqnr_db > rtn.accuracy.sqnr_db


def test_search_picks_valid_calibrators_and_is_no_worse_than_minmax(preps):
    prep = preps(Variant.SWIGLU)
    picks = search_calibrators(prep.model, prep.table, "w8a8", prep.calib[:256], candidates=["minmax", "mse", "percentile:99.9"])
    assert set(picks) == {"input", "hidden"} and set(picks.values()) <= {"minmax", "mse", "percentile:99.9"}
    mm = quantize_model(prep.model, "w8a8", prep.table, calibrator="minmax")
    best = quantize_model(prep.model, "w8a8", prep.table, calibrator=picks)
    with torch.no_grad():
        ref = prep.model(prep.calib[:256])
        assert sqnr_db(ref, best(prep.calib[:256])) >= sqnr_db(ref, mm(prep.calib[:256])) - 1e-9


def test_static_scheme_without_ranges_is_an_error():
    model = build(FFNSpec("swiglu", d_model=D))
    with pytest.raises(FFNQuantError, match="calibration ranges are required"):
        quantize_model(model, "w8a8", None)
    quantize_model(model, "w8a16", None)  # weight-only needs none


def test_in_memory_tokens_and_nan_rejection():
    spec = FFNSpec("relu", d_model=D)
    calib, ev = gaussian_tokens(512, D, 1), gaussian_tokens(256, D, 2)
    r = quantize_spec(spec, "w8a8@minmax", calib_tokens=calib, eval_tokens=ev, onnx=False, sensitivity=False)
    assert r.source == "in-memory tokens" and r.n_eval == 256
    bad = calib.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(FFNQuantError, match="NaN"):
        quantize_spec(spec, "w8a8", calib_tokens=bad, eval_tokens=ev, onnx=False)


def test_quantize_spec_takes_a_recipe_and_checks_the_prepared_remedies(preps):
    prep = preps(Variant.RELU)
    r = quantize_spec(prep.spec, Recipe("w8a8", "minmax"), prepared=prep, onnx=False, sensitivity=False)
    assert r.recipe == Recipe("w8a8", "minmax") and r.qmodel.recipe == r.recipe and r.calibrator == "minmax"
    assert r.to_dict()["recipe"] == "w8a8@minmax"
    with pytest.raises(FFNQuantError, match="prepared with its remedies"):  # smooth, but prepared without
        quantize_spec(prep.spec, "w8a8+smooth", prepared=prep, onnx=False)
    with pytest.raises(FFNQuantError, match="beside `prepared`"):  # would be ignored: an error, not dead
        quantize_spec(prep.spec, "w8a8", prepared=prep, seed=3, onnx=False)


def test_prepare_takes_the_remedies_from_the_recipe():
    spec = FFNSpec("relu", d_model=D)
    prep = prepare(spec, "gaussian", 256, 128, recipe=Recipe("w8a8", smooth=0.3, rotate=True))
    assert (prep.smooth, prep.rotate) == (0.3, True) and [r.kind for r in prep.remedies] == ["smooth", "rotate"]
    assert prep.remedy_slug == Recipe("w8a8", smooth=0.3, rotate=True).remedy_slug == "smooth0.3-rotate"
    with pytest.raises(FFNQuantError, match="not both"):
        prepare(spec, "gaussian", 256, 128, smooth=0.5, recipe=Recipe("w8a8", smooth=0.5))


def test_group_size_not_dividing_pads_the_width():
    """d_model 48 with groups of 32 (it used to be refused): the weights keep their shapes, w_up/w_gate
    get 2 groups per row (32 + 16 real columns), and the model runs."""
    model = build(FFNSpec("swiglu", d_model=48))
    q = quantize_model(model, "w4a16-g32")
    for name, w in model.weights().items():
        assert q.model.weights()[name].shape == w.shape
    x = gaussian_tokens(64, 48, seed=0)
    assert sqnr_db(model(x), q(x)) > 10.0


@pytest.mark.parametrize("scheme", ["w4a16-g64", "w4a16-g64-asym", "w4a16-g128", "w8g64", "nf4", "fp4"], ids=str)
def test_quantize_weight_any_width_within_half_a_step(scheme):
    """K = 96 with g = 64 (and g = 128 > K): the cropped image has the input's shape and every real
    weight lies within half its group's step (int grids) or inside its block's absmax (nf4/fp4)."""
    from ffnquant.numerics import primitives as P
    from ffnquant.methods.fakequant import quantize_weight
    from ffnquant.schemes import Granularity, Scheme, WeightDType, get_scheme

    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    w[:, 64:] = w[:, 64:].abs() + 0.01  # an all-positive last partial group: padding must not widen its range
    sch = (Scheme("w8g64", WeightDType.INT8, Granularity.PER_GROUP, group_size=64, weight_symmetric=False)
           if scheme == "w8g64" else get_scheme(scheme))
    wq = quantize_weight(w, sch)
    assert wq.shape == w.shape and torch.isfinite(wq).all()
    g = sch.group_size
    if sch.weight_dtype in (WeightDType.NF4, WeightDType.FP4):
        flat, qflat = w.reshape(-1), wq.reshape(-1)
        for i in range(0, flat.numel(), g):
            assert qflat[i:i + g].abs().max() <= flat[i:i + g].abs().max() * (1 + 1e-6)
        return
    bits = 8 if sch.weight_dtype is WeightDType.INT8 else 4
    levels = 2 ** bits - 1
    for j in range(0, 96, g):
        grp, qgrp = w[:, j:j + g], wq[:, j:j + g]
        lo = grp.amin(1, keepdim=True).clamp(max=0)
        hi = grp.amax(1, keepdim=True).clamp(min=0)
        err = (grp - qgrp).abs()
        if sch.weight_symmetric:  # the signed extreme on code -8: step = |extreme| / 8, and the
            step = torch.maximum(-lo, hi) / 8  # other sign reaches 7 steps only (beyond: within a step)
            assert (err <= step * (1 + 1e-4)).all()
            err = torch.where(grp.abs() <= 7 * step, err, torch.zeros_like(err))
        else:
            step = (hi - lo) / levels
        assert (err <= step / 2 * (1 + 1e-4) + 1e-7).all()


def test_metrics_on_a_hand_built_pair():
    ref = torch.tensor([3.0, 4.0])
    got = torch.tensor([3.0, 4.5])
    # ||ref|| = 5, ||ref - got|| = 0.5: 20 dB, rel L2 0.1
    assert math.isclose(sqnr_db(ref, got), 20.0, rel_tol=1e-9)
    assert math.isclose(rel_l2(ref, got), 0.1, rel_tol=1e-9)
    assert math.isclose(cosine(ref, got), (9 + 18) / (5 * math.hypot(3, 4.5)), rel_tol=1e-9)
    acc = accuracy_of(ref[None], got[None])
    assert acc.max_abs_error == 0.5 and sqnr_db(ref, ref) == 200.0


# --- the grid a quantized weight lies on (what deployment formats store) ------------------------

_GRID_PRESETS = ["w8a8", "w8a16", "w4a16-g32", "w4a16-g32-asym", "w4a16-g128", "w4a16-g32-gptq", "fp8-e4m3",
                 "fp8-e4m3-pc"]


@pytest.mark.parametrize("preset", _GRID_PRESETS)
def test_weight_grid_reproduces_the_dequantized_weight_exactly(preset):
    """(code - zero_point) * scale on the grid's signed range gives back quantize_weight's image bit for bit; the
    codes a format derives as round(w / scale) + zero_point are integers on that range (a 200-wide input pads
    the last group of 128 and of 32 is exact)."""
    from ffnquant.methods.fakequant import quantize_weight, weight_grid
    from ffnquant.schemes import get_scheme

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 200, generator=gen) * 0.05
    x = torch.randn(300, 200, generator=gen)
    scheme = get_scheme(preset)
    deq, grid = weight_grid(w, scheme, (x.T @ x).double())
    assert torch.equal(deq, quantize_weight(w, scheme, (x.T @ x).double()))
    scale = grid.scale
    if grid.granularity == "per_group":  # [out, groups] -> per column, cropped to the real width
        scale = scale.repeat_interleave(grid.group_size, dim=1)[:, : w.shape[1]]
    if grid.kind == "fp8":
        assert torch.equal((deq / scale).to(torch.float8_e4m3fn).float() * scale, deq)
        return
    zp = grid.zero_point
    if grid.granularity == "per_group":
        zp = zp.repeat_interleave(grid.group_size, dim=1)[:, : w.shape[1]]
    codes = torch.round(deq / scale) + zp
    assert codes.min() >= grid.qmin and codes.max() <= grid.qmax
    assert torch.equal((codes - zp.float()) * scale, deq)
    if grid.symmetric:  # no zero point stored: it must be 0 everywhere
        assert (grid.zero_point == 0).all()


@pytest.mark.parametrize("preset", ["fp32", "fp16", "nf4", "w4a16-g32-hqq"])
def test_formats_without_an_integer_grid_say_so(preset):
    from ffnquant.methods.fakequant import weight_grid
    from ffnquant.schemes import get_scheme

    assert weight_grid(torch.randn(8, 64), get_scheme(preset))[1] is None


def test_quantize_model_records_each_quantized_weights_grid():
    model = build(FFNSpec(Variant.SWIGLU, 32, 64), seed=0)
    q = quantize_model(model, "w4a16-g32")
    assert set(q.weight_grids) == {"w_up", "w_gate", "w_down"}
    assert q.weight_grids["w_down"].scale.shape == (32, 2)


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16-g32", "w8a8"], ids=str)
def test_the_quantized_module_and_its_linears_hold_one_weight_and_compact_codes(scheme):
    """What an export keeps per weight: the decoded values once (the module's weight is the QuantizedLinear's, in the
    float weight's layout) and int8 codes that decode to them exactly."""
    spec = FFNSpec(Variant.SWIGLU, d_model=64, d_ff=128)
    prep = prepare(spec, "gaussian", 64, 32)
    qm = quantize_model(prep.model, scheme, prep.table, calibrator="minmax")
    assert set(qm.linears) == set(spec.weight_names)
    for name, ql in qm.linears.items():
        weight = getattr(qm.model, name).weight
        assert ql.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        assert ql.codes.dtype == torch.int8
        scale = ql.grid.scale if ql.grid.granularity != "per_group" else ql.grid.scale.repeat_interleave(32, 1)
        zp = ql.grid.zero_point if ql.grid.granularity != "per_group" else ql.grid.zero_point.repeat_interleave(32, 1)
        scale = scale.reshape(-1, 1) if scale.ndim == 1 else scale
        zp = zp.reshape(-1, 1) if zp.ndim == 1 else zp
        assert torch.equal(((ql.codes.to(torch.int32) - zp).float() * scale)[:, : weight.shape[1]], weight)
