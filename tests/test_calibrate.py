"""Calibrators: ranges from histograms only, expected-error model against measured error, registry errors."""

import math

import numpy as np
import pytest
import torch

from ffnquant.numerics import primitives as P
from ffnquant.numerics.calibrate import (
    CALIBRATORS, Grid, Histogram, calibrate_range, expected_mse, histogram_of, parse_calibrator,
)
from ffnquant.errors import FFNQuantError
from ffnquant.numerics.histogram import StreamingHistogram
from ffnquant.numerics.observe import TensorObserver

RNG = np.random.default_rng(0)
DATA = {
    "gaussian": RNG.standard_normal(40_000),
    "relu": np.maximum(RNG.standard_normal(40_000), 0.0),
    "heavy-t3": RNG.standard_t(3, 40_000),
}
GRIDS = {"uint8-asym": Grid(0, 255, False), "int8-sym": Grid(-128, 127, True), "fp8": Grid(0, 0, True, "fp8_e4m3")}
NAMES = ["minmax", "percentile", "percentile:99.9", "entropy", "mse", "auto"]


def _hist(x):
    counts, edges = np.histogram(x, bins=2048)
    return Histogram(counts, edges, float(x.min()), float(x.max()))


def _measured_mse(x, grid, lo, hi):
    xt = torch.tensor(x, dtype=torch.float32)
    if grid.kind == "fp8_e4m3":
        y = P.fp8_e4m3_fake(xt, max(abs(lo), abs(hi)) / P.FP8_E4M3_MAX)
    else:
        s, z = P.choose_qparams(lo, hi, grid.qmin, grid.qmax, grid.symmetric)
        y = P.fake_quantize(xt, s, z, grid.qmin, grid.qmax)
    return float(((xt - y) ** 2).mean())


@pytest.mark.parametrize("data", DATA, ids=str)
@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("name", NAMES, ids=str)
def test_range_lies_within_the_data_and_holds_most_of_it(data, grid, name):
    x, g = DATA[data], GRIDS[grid]
    lo, hi, used, err = calibrate_range(_hist(x), g, name)
    assert x.min() - 1e-9 <= lo <= hi <= x.max() + 1e-9
    assert err >= 0
    # entropy (KL) is known to clip hard on heavy tails; every other calibrator keeps 99% of the mass
    if name != "entropy":
        assert np.mean((x >= min(lo, 0)) & (x <= max(hi, 0))) >= 0.99


@pytest.mark.parametrize("data", DATA, ids=str)
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_expected_error_model_matches_measured_error(data, grid):
    x, g = DATA[data], GRIDS[grid]
    h = _hist(x)
    for name in ("minmax", "mse", "percentile"):
        lo, hi, _, err = calibrate_range(h, g, name)
        measured = _measured_mse(x, g, lo, hi)
        assert math.isclose(err, measured, rel_tol=0.25), (name, err, measured)


@pytest.mark.parametrize("data", DATA, ids=str)
def test_mse_and_auto_are_no_worse_than_minmax(data):
    x, g = DATA[data], GRIDS["uint8-asym"]
    h = _hist(x)
    mm = _measured_mse(x, g, *calibrate_range(h, g, "minmax")[:2])
    for name in ("mse", "auto"):
        lo, hi, used, _ = calibrate_range(h, g, name)
        assert _measured_mse(x, g, lo, hi) <= mm * 1.02
    assert calibrate_range(h, g, "auto")[2] in ("minmax", "mse") or calibrate_range(h, g, "auto")[2].startswith("percentile")


def test_relu_keeps_a_one_sided_range():
    lo, hi, _, _ = calibrate_range(_hist(DATA["relu"]), GRIDS["uint8-asym"], "mse")
    assert lo == 0.0 and hi > 3.0


def test_entropy_threshold_on_a_gaussian_is_a_few_sigma():
    lo, hi, _, _ = calibrate_range(_hist(DATA["gaussian"]), GRIDS["int8-sym"], "entropy")
    assert 2.5 < hi < 4.8 and math.isclose(-lo, hi)


def test_percentile_parameter():
    h = _hist(DATA["gaussian"])
    _, hi999, name, _ = calibrate_range(h, GRIDS["int8-sym"], "percentile:99.9")
    _, hi99, _, _ = calibrate_range(h, GRIDS["int8-sym"], "percentile:99")
    assert name == "percentile:99.9" and hi99 < hi999
    assert math.isclose(hi999, np.quantile(np.abs(DATA["gaussian"]), 0.999), rel_tol=0.02)


@pytest.mark.parametrize(
    "name, message",
    [
        pytest.param("kl", "unknown calibrator 'kl'; valid: minmax, percentile, entropy, mse, auto", id="unknown"),
        pytest.param("percentile:abc", "must be a number", id="bad-number"),
        pytest.param("percentile:0", r"in \(0, 100\]", id="out-of-range"),
        pytest.param("mse:3", "takes no parameter", id="param-on-mse"),
    ],
)
def test_bad_calibrator_names(name, message):
    with pytest.raises(FFNQuantError, match=message):
        parse_calibrator(name)


def test_registry_names():
    assert {"minmax", "percentile", "entropy", "mse", "auto"} <= set(CALIBRATORS)


def test_reads_observe_histograms_and_observers():
    x = torch.randn(4096, 16)
    sh = StreamingHistogram(512)
    sh.update(x)
    obs = TensorObserver(512, "t").update(x)
    h1, h2 = histogram_of(sh), histogram_of(obs)
    assert h2.lo == float(x.min()) and h2.hi == float(x.max())  # the observer's exact extremes
    assert h1.counts.sum() == h2.counts.sum() == x.numel()
    lo, hi, _, _ = calibrate_range(obs, GRIDS["uint8-asym"], "minmax")
    assert (lo, hi) == (float(x.min()), float(x.max()))


@pytest.mark.parametrize(
    "counts, edges, message",
    [
        pytest.param([0, 0], [0, 1, 2], "empty", id="empty"),
        pytest.param([1, np.nan], [0, 1, 2], "non-finite", id="nan"),
        pytest.param([1, 2], [0, 1], "n counts and n\\+1 edges", id="shape"),
        pytest.param([1, 2], [0, 2, 1], "increase", id="edges-order"),
    ],
)
def test_bad_histograms(counts, edges, message):
    with pytest.raises(FFNQuantError, match=message):
        Histogram(counts, edges)


def test_expected_mse_grows_with_clipping():
    h = _hist(DATA["gaussian"])
    g = GRIDS["int8-sym"]
    assert expected_mse(h, g, -1.0, 1.0) > expected_mse(h, g, -4.0, 4.0)


def _entropy_kl_scan(hist, i, n_quant):
    """TensorRT's entropy calibration for one threshold, written as the loop it describes: the reference the
    vectorised `_entropy_kls` is held to."""
    ref = hist[:i].copy()
    ref[i - 1] += hist[i:].sum()
    src = hist[:i]
    nz = src > 0
    idx = (np.arange(i) * n_quant) // i
    level_mass = np.bincount(idx, weights=src, minlength=n_quant)
    level_nz = np.bincount(idx, weights=nz.astype(float), minlength=n_quant)
    q = np.where(nz, level_mass[idx] / np.maximum(level_nz[idx], 1), 0.0)
    if q.sum() <= 0:
        return math.nan
    pp, qq = ref / ref.sum(), q / q.sum()
    m = pp > 0
    if np.any(m & (qq <= 0)):
        return math.inf
    return float(np.sum(pp[m] * np.log(pp[m] / qq[m])))


ENTROPY_CASES = {
    "heavy-t3-outliers": np.concatenate([RNG.standard_t(3, 20_000), [90.0, -120.0]]),
    "sparse-relu": np.maximum(RNG.standard_normal(20_000), 0.0) * (RNG.random(20_000) < 0.1),
    "few-levels": RNG.integers(-3, 4, 2_000) * 0.25,
    "gaussian": RNG.standard_normal(20_000),
}


@pytest.mark.parametrize("bins", [2048, 300, 129], ids=lambda b: f"{b}bins")
@pytest.mark.parametrize("n_quant", [128, 8], ids=lambda q: f"{q}levels")
@pytest.mark.parametrize("data", ENTROPY_CASES, ids=str)
def test_the_vectorised_entropy_kls_are_the_loops(data, n_quant, bins):
    from ffnquant.numerics.calibrate import _entropy_kls

    hist, _ = np.histogram(np.abs(ENTROPY_CASES[data]), bins=bins)
    hist = hist.astype(np.float64)
    if hist.size <= n_quant:
        pytest.skip("no threshold to try")
    cuts = np.arange(n_quant, hist.size + 1, max(1, (hist.size - n_quant) // 512))
    got = _entropy_kls(hist, cuts, n_quant)
    want = np.array([_entropy_kl_scan(hist, int(i), n_quant) for i in cuts])
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    # the two sum the same terms in another order: float64 rounding, relative to the divergences' size
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_empty_bins_add_nothing_to_the_expected_error(grid):
    """`_mse_curve` reads the bins holding mass only: the same histogram with and without empty bins between."""
    x = DATA["heavy-t3"]
    counts, edges = np.histogram(x, bins=64)
    wide = Histogram(counts, edges)
    # split every bin in two, the mass on the first half: half the bins empty, the same centres of mass
    fine_edges = np.sort(np.concatenate([edges, 0.5 * (edges[:-1] + edges[1:])]))
    fine = np.zeros(2 * counts.size)
    fine[0::2] = counts
    split = Histogram(fine, fine_edges)
    for lo, hi in [(wide.lo, wide.hi), (wide.lo / 3, wide.hi / 3)]:
        dense = Histogram(fine + 1e-300, fine_edges)  # every bin "reached", at no mass
        assert expected_mse(split, GRIDS[grid], lo, hi) == pytest.approx(expected_mse(dense, GRIDS[grid], lo, hi),
                                                                        rel=1e-12)
