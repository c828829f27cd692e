"""Recommendations follow from the numbers: synthetic points with hand-checked answers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ffnquant.errors import FFNQuantError
from ffnquant.measure.recommend import Point, crest_cost_finding, pareto_front, recommend, recommend_all


def pt(scheme, latency, sqnr, runtime="ort-cpu", tokens=512, variant="swiglu", label=""):
    return Point(variant, scheme, runtime, tokens, latency, sqnr, label)


# A typical CPU picture: int8 static is fastest but below target, dynamic meets it, 4-bit is slow.
CPU = [
    pt("fp32", 0.040, None),
    pt("fp16", 0.080, 70.0),
    pt("w8a8", 0.015, 25.1, label="w8a8 (mse)"),
    pt("w8a8-dynamic", 0.017, 31.0),
    pt("w4a16-g128", 0.041, 19.0),
]


def test_pareto_front_drops_dominated_points():
    front = pareto_front(CPU)
    assert [p.scheme for p in front] == ["w8a8", "w8a8-dynamic", "fp32"]
    # fp16 is slower and less accurate than fp32; w4a16 slower and less accurate than w8a8-dynamic.
    lat = [p.latency_s for p in front]
    assert lat == sorted(lat)


def test_pareto_front_equal_latency_keeps_the_more_accurate():
    front = pareto_front([pt("a", 0.01, 20.0), pt("b", 0.01, 30.0)])
    assert [p.scheme for p in front] == ["b"]


def test_fastest_scheme_meeting_target_with_reason():
    rec = recommend(CPU, target_db=30.0)
    assert rec.choice == "w8a8-dynamic" and rec.meets_target
    assert rec.speedup == pytest.approx(0.040 / 0.017)
    assert rec.reason == "w8a8-dynamic: 31.0 dB >= 30 dB target, 2.4x faster than fp32 on ort-cpu at M=512"


def test_lower_target_picks_the_faster_static_scheme():
    rec = recommend(CPU, target_db=25.0)
    assert rec.choice == "w8a8"
    assert rec.reason.startswith("w8a8 (mse): 25.1 dB >= 25 dB target, 2.7x faster than fp32")


def test_baseline_wins_when_no_quantized_scheme_is_faster_and_accurate():
    pts = [pt("fp32", 0.010, None), pt("w4a16-g128", 0.012, 19.0), pt("w8a16", 0.020, 40.0)]
    rec = recommend(pts, target_db=30.0)
    assert rec.choice == "fp32" and rec.meets_target and rec.speedup == 1.0
    assert "no quantized scheme meeting 30 dB is faster" in rec.reason
    assert "w4a16-g128, reaches only 19.0 dB" in rec.reason
    assert "w8a16 (40.0 dB) is 2.0x slower" in rec.reason


def test_nothing_meets_target_names_the_most_accurate():
    pts = [pt("w8a8", 0.01, 22.0), pt("w4a16-g128", 0.02, 18.0)]  # no fp32 measured on this runtime
    rec = recommend(pts, target_db=30.0)
    assert not rec.meets_target and rec.choice == "w8a8" and rec.speedup is None
    assert rec.reason == (
        "nothing meets the 30 dB target on ort-cpu at M=512; the most accurate is w8a8 at 22.0 dB "
        "(no fp32 baseline measured on ort-cpu)"
    )


def test_slower_choice_says_slower():
    pts = [pt("fp32", 0.010, None), pt("fp16", 0.009, 60.0)]
    assert "1.1x faster" in recommend(pts).reason
    pts = [pt("fp32", 0.010, 50.0), pt("nf4", 0.030, 31.0)]  # fp32 with a number: treated like any scheme
    rec = recommend(pts, target_db=30.0)
    assert rec.choice == "fp32"


def test_recommend_all_groups_per_variant_runtime_tokens():
    pts = CPU + [pt("fp32", 0.002, None, tokens=1), pt("w8a8-dynamic", 0.001, 31.0, tokens=1),
                 pt("fp32", 0.003, None, runtime="torch")]
    recs = recommend_all(pts, target_db=30.0)
    assert [(r.runtime, r.tokens, r.choice) for r in recs] == [
        ("ort-cpu", 1, "w8a8-dynamic"), ("ort-cpu", 512, "w8a8-dynamic"), ("torch", 512, "fp32")]


@pytest.mark.parametrize("bad", [pytest.param([], id="empty"),
                                 pytest.param([pt("a", 0.1, 1.0), pt("b", 0.1, 1.0, runtime="x")], id="mixed")])
def test_recommend_rejects_bad_groups(bad):
    with pytest.raises(FFNQuantError):
        recommend(bad)


@pytest.mark.parametrize("latency", [0.0, -1.0, math.nan], ids=str)
def test_point_rejects_bad_latency(latency):
    with pytest.raises(FFNQuantError):
        pt("fp32", latency, None)


def test_crest_cost_finding_from_numbers():
    crest = {"relu": 9.0, "gelu": 9.5, "swiglu": 22.5, "geglu": 20.0}
    sqnr = {"relu": 32.0, "gelu": 31.5, "swiglu": 25.0, "geglu": 26.0}
    f = crest_cost_finding(crest, sqnr, scheme="w8a8")
    assert f["wide"] == "swiglu" and f["narrow"] == "relu"
    assert f["crest_ratio"] == pytest.approx(2.5)
    assert f["cost_db"] == pytest.approx(7.0)
    assert "2.5x wider" in f["text"] and "costs 7.0 dB" in f["text"]
    # Slope of a least-squares line through (log2 crest, dB): negative, steeper than -5 dB/doubling here.
    assert -9.0 < f["slope_db_per_doubling"] < -5.0


def test_crest_cost_finding_falls_back_to_extremes_and_needs_two():
    f = crest_cost_finding({"gelu": 9.0, "reglu": 21.0}, {"gelu": 31.0, "reglu": 27.0})
    assert (f["wide"], f["narrow"]) == ("reglu", "gelu") and f["slope_db_per_doubling"] is None
    assert crest_cost_finding({"relu": 9.0}, {"relu": 30.0}) is None


# --- speedups must clear the measured spread -----------------------------------------------------
def spread(scheme, p10, median, p90, sqnr, **kw):
    return Point(kw.get("variant", "swiglu"), scheme, "torch-cpu", 16, median, sqnr, "", p10, p90)


BASE = spread("fp32", 0.0095, 0.0100, 0.0110, None)


def test_a_speedup_inside_the_spread_keeps_the_baseline():
    """A 2% lower median whose p90 overlaps the baseline's p10 is noise, not '1.0x faster'."""
    rec = recommend([BASE, spread("w8a8-dynamic-s8", 0.0090, 0.0098, 0.0106, 35.0)], target_db=30.0)
    assert rec.choice == "fp32" and rec.speedup == 1.0
    assert rec.reason == (
        "fp32: no quantized scheme meeting 30 dB is faster on torch-cpu at M=16 (w8a8-dynamic-s8 meets it "
        "(35.0 dB) but is 1.02x faster only within the measured spread (its p90 10.6 ms is not below the "
        "fp32 p10 9.5 ms))"
    )


def test_a_speedup_beyond_the_spread_is_recommended():
    rec = recommend([BASE, spread("w8a8-dynamic-s8", 0.0080, 0.0085, 0.0090, 35.0)], target_db=30.0)
    assert rec.choice == "w8a8-dynamic-s8" and rec.speedup == pytest.approx(0.0100 / 0.0085)
    assert rec.reason == "w8a8-dynamic-s8: 35.0 dB >= 30 dB target, 1.2x faster than fp32 on torch-cpu at M=16"


def test_the_fastest_scheme_clear_of_the_spread_wins_over_a_noisier_faster_median():
    noisy = spread("w8a16", 0.0060, 0.0080, 0.0120, 40.0)  # lower median, p90 above the baseline's p10
    steady = spread("w8a8", 0.0088, 0.0090, 0.0093, 33.0)
    assert recommend([BASE, noisy, steady], target_db=30.0).choice == "w8a8"


def test_close_speedups_print_two_decimals():
    rec = recommend([BASE, spread("fp16", 0.0090, 0.0093, 0.0094, 70.0)], target_db=30.0)
    assert rec.choice == "fp16" and "1.08x faster than fp32" in rec.reason


@pytest.mark.parametrize("p10, p90", [(0.002, 0.001), (-1.0, 0.001), (0.001, math.inf)], ids=["crossed", "negative", "inf"])
def test_point_rejects_bad_percentiles(p10, p90):
    with pytest.raises(FFNQuantError, match="p10|p90"):
        Point("relu", "fp32", "torch-cpu", 1, 0.0015, None, "", p10, p90)


# --- timings not to trust (issue 27, item 6) --------------------------------------------------------
def test_a_suspect_quantized_point_is_never_recommended():
    """gelu on bnb-cpu at M=1 was 'fp16 (139.5x)' from a 139x ratio the roofline does not allow."""
    points = [pt("fp32", 0.0202, None), pt("fp16", 0.000145, 70.0)]
    points[1] = dataclasses.replace(points[1], suspect="139x faster than fp32, beyond the roofline's 4x")
    rec = recommend(points, 30.0)
    assert rec.choice == "fp32" and rec.speedup == 1.0
    assert "not used, timing suspect: fp16: 139x faster than fp32, beyond the roofline's 4x" in rec.reason


def test_a_suspect_baseline_calls_nothing_faster():
    """A 2-sample fp32 case (median 20.2 ms on a loaded machine): no scheme is called faster than it."""
    points = [Point("gelu", "fp32", "bnb-cpu", 1, 0.0202, None, suspect="2 samples (fewer than 5)"),
              Point("gelu", "fp16", "bnb-cpu", 1, 0.000145, 70.0)]
    rec = recommend(points, 30.0)
    assert rec.choice == "fp32" and rec.label == "fp32 (timing suspect)"
    assert rec.speedup is None and rec.latency_s is None
    assert "suspect (fp32: 2 samples (fewer than 5))" in rec.reason


def test_only_suspect_points_recommend_nothing():
    rec = recommend([Point("swiglu", "w8a8", "ort-cpu", 512, 0.01, 30.0, suspect="2 samples (fewer than 5)")], 20.0)
    assert rec.choice is None and rec.meets_target is False and "no timing" in rec.reason
