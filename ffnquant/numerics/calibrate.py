"""Calibrators: a clipping range (lo, hi) for one tensor site from its streaming histogram.

Every calibrator reads only a histogram (counts over signed bin edges, plus the exact
min/max when the observer has them) and the target grid, never stored activations, so
calibration memory is bounded by the bin count (onnxruntime #10503, #11020).

Registry (`CALIBRATORS`): `minmax`, `percentile[:P]` (default 99.99), `entropy` (TensorRT's
KL-divergence search), `mse` (the range minimising the expected quantization error on the
histogram), `auto` (per site, whichever of the others has the lowest expected error on the
histogram) and `search` (per site, whichever gives the lowest FFN output error on calibration
tokens: see `ffnquant.quantization.search_calibrators`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import FFNQuantError, unknown_choice

__all__ = [
    "Histogram",
    "Grid",
    "Calibrator",
    "CALIBRATORS",
    "CANDIDATES",
    "calibrator_names",
    "parse_calibrator",
    "histogram_of",
    "expected_mse",
    "calibrate_range",
]


@dataclass(frozen=True)
class Histogram:
    """Counts over `len(counts) + 1` increasing signed edges; `lo`/`hi` are the exact extremes when known."""

    counts: np.ndarray
    edges: np.ndarray
    lo: float | None = None
    hi: float | None = None

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.float64).reshape(-1)
        edges = np.asarray(self.edges, dtype=np.float64).reshape(-1)
        if edges.size != counts.size + 1 or counts.size == 0:
            raise FFNQuantError(f"histogram needs n counts and n+1 edges, got {counts.size} and {edges.size}")
        if not (np.all(np.isfinite(edges)) and np.all(np.isfinite(counts))):
            raise FFNQuantError("histogram has non-finite edges or counts (NaN or inf in the data?)")
        if np.any(np.diff(edges) <= 0) or np.any(counts < 0):
            raise FFNQuantError("histogram edges must increase and counts be non-negative")
        if counts.sum() <= 0:
            raise FFNQuantError("histogram is empty: no calibration data reached this site")
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "edges", edges)
        nz = np.nonzero(counts)[0]
        lo = float(edges[nz[0]]) if self.lo is None else float(self.lo)
        hi = float(edges[nz[-1] + 1]) if self.hi is None else float(self.hi)
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "hi", hi)

    @property
    def centers(self) -> np.ndarray:
        return 0.5 * (self.edges[:-1] + self.edges[1:])

    @property
    def widths(self) -> np.ndarray:
        return np.diff(self.edges)


def histogram_of(obj: Any) -> Histogram:
    """A Histogram from a Histogram, a StreamingHistogram-like (.counts, .edges) or a TensorObserver-like (.histogram, .min, .max)."""
    if isinstance(obj, Histogram):
        return obj
    hist = getattr(obj, "histogram", None)
    if hist is not None and hasattr(hist, "counts"):
        lo, hi = getattr(obj, "min", None), getattr(obj, "max", None)
        lo = None if lo is None or not math.isfinite(float(lo)) else float(lo)
        hi = None if hi is None or not math.isfinite(float(hi)) else float(hi)
        return Histogram(np.asarray(hist.counts), np.asarray(hist.edges), lo, hi)
    if hasattr(obj, "counts") and hasattr(obj, "edges"):
        return Histogram(np.asarray(obj.counts), np.asarray(obj.edges))
    raise FFNQuantError(f"cannot read a histogram from {type(obj).__name__}")


@dataclass(frozen=True)
class Grid:
    """The target quantization grid: integers qmin..qmax (affine or symmetric) or fp8 e4m3 (scale only)."""

    qmin: int = 0
    qmax: int = 255
    symmetric: bool = False
    kind: str = "int"  # "int" or "fp8_e4m3"

    def __post_init__(self) -> None:
        if self.kind not in ("int", "fp8_e4m3"):
            raise FFNQuantError(f"unknown grid kind {self.kind!r}; valid: int, fp8_e4m3")
        if self.kind == "int" and self.qmax <= self.qmin:
            raise FFNQuantError(f"grid needs qmax > qmin, got {self.qmin}..{self.qmax}")

    @classmethod
    def for_act(cls, act_dtype: str, symmetric: bool) -> "Grid":
        """The grid of a scheme's activation dtype (uint8, int8, fp8_e4m3)."""
        a = str(getattr(act_dtype, "value", act_dtype))
        if a == "uint8":
            return cls(0, 255, symmetric)
        if a == "int8":
            return cls(-128, 127, symmetric)
        if a == "fp8_e4m3":
            return cls(0, 0, True, "fp8_e4m3")
        raise FFNQuantError(f"no calibration grid for activation dtype {a!r}")

    @property
    def levels(self) -> int:
        return self.qmax - self.qmin + 1 if self.kind == "int" else 256

    def step(self, lo: float, hi: float) -> float:
        """The grid's quantization step (integer grids) for the range [lo, hi], zero included."""
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        if self.symmetric:
            zp = (self.qmin + self.qmax + 1) // 2
            return max(-lo, hi) / (self.qmax - zp)
        return (hi - lo) / (self.qmax - self.qmin)


def _representable(grid: Grid, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The clipping limits the grid really has for ranges [lo, hi] (symmetric grids mirror the wider side)."""
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    if grid.symmetric:
        a = np.maximum(-lo, hi)
        return -a, a
    return lo, hi


def _mse_curve(h: Histogram, grid: Grid, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Expected squared error per value for each candidate range (lo[k], hi[k]); shape [k]."""
    # the bins holding mass only: an empty bin adds nothing, and a trained model's activations leave most of a wide
    # histogram empty (heavy tails: 2048 bins, a few hundred reached), so [k, bins] shrinks to [k, reached]
    nz = h.counts > 0
    c = h.centers[nz][None, :]
    w = h.widths[nz][None, :]
    p = (h.counts[nz] / h.counts.sum())[None, :]
    lo_r, hi_r = _representable(grid, np.asarray(lo, float)[:, None], np.asarray(hi, float)[:, None])
    clipped = np.clip(c, lo_r, hi_r)
    clip_err = (c - clipped) ** 2
    inside = (c >= lo_r) & (c <= hi_r)
    if grid.kind == "int":
        if grid.symmetric:
            zp = (grid.qmin + grid.qmax + 1) // 2
            step = hi_r / (grid.qmax - zp)
        else:
            step = (hi_r - lo_r) / (grid.qmax - grid.qmin)
        step = np.where(step > 0, step, 1.0)
        # rounding noise: uniform step^2/12 when bins are as wide as a step; for narrower bins the
        # centre's own rounding error (exact for the zeros of ReLU, which the grid holds exactly)
        center_err = (c - np.round(c / step) * step) ** 2 + w**2 / 12
        round_err = np.where(w < step, center_err, step**2 / 12)
    else:
        scale = np.maximum(hi_r, 1e-30) / 448.0
        y = np.abs(c) / scale
        # e4m3: 3 mantissa bits, exponent floor -6 (subnormal spacing 2^-9)
        ulp = np.exp2(np.floor(np.log2(np.maximum(y, 2.0**-6))) - 3)
        round_err = (ulp * scale) ** 2 / 12
    return np.sum(p * (clip_err + inside * round_err), axis=1)


def expected_mse(h: Histogram, grid: Grid, lo: float, hi: float) -> float:
    """Expected squared quantization error per value of the histogram's distribution with range [lo, hi]."""
    return float(_mse_curve(h, grid, np.array([lo]), np.array([hi]))[0])


def _quantile(h: Histogram, q: float) -> float:
    """Value below which a fraction q of the mass lies (linear inside bins)."""
    cdf = np.concatenate([[0.0], np.cumsum(h.counts)]) / h.counts.sum()
    return float(np.interp(q, cdf, h.edges))


def _abs_histogram(h: Histogram) -> Histogram:
    """Fold a signed histogram onto |x| (bins of the wider side's width, from 0)."""
    top = max(abs(h.lo), abs(h.hi))
    n = h.counts.size
    edges = np.linspace(0.0, top, n + 1)
    counts, _ = np.histogram(np.abs(h.centers), bins=edges, weights=h.counts)
    if counts.sum() <= 0:  # all mass on bin centres beyond `top` (a single-bin histogram)
        counts[-1] = h.counts.sum()
    return Histogram(counts, edges, 0.0, top)


# --- the calibrators ----------------------------------------------------------------------


def _minmax(h: Histogram, grid: Grid) -> tuple[float, float]:
    return h.lo, h.hi


def _percentile(p: float) -> Callable[[Histogram, Grid], tuple[float, float]]:
    def percentile(h: Histogram, grid: Grid) -> tuple[float, float]:
        if grid.symmetric or grid.kind != "int":
            a = _quantile(_abs_histogram(h), p / 100.0)
            return max(h.lo, -a), min(h.hi, a)
        tail = (100.0 - p) / 100.0
        lo = _quantile(h, tail) if h.lo < 0 else h.lo
        hi = _quantile(h, 1.0 - tail) if h.hi > 0 else h.hi
        return lo, hi

    return percentile


def _entropy(h: Histogram, grid: Grid) -> tuple[float, float]:
    """TensorRT's entropy calibration: the |x| threshold minimising KL(P || Q) with Q on the grid's levels."""
    one_sided = h.lo >= 0 and not grid.symmetric
    a = _abs_histogram(h)
    n_quant = grid.levels if one_sided else grid.levels // 2
    hist = a.counts
    n = hist.size
    if n <= n_quant:
        return h.lo, h.hi
    cuts = np.arange(n_quant, n + 1, max(1, (n - n_quant) // 512))  # the thresholds tried: the first `i` bins kept
    kl = _entropy_kls(hist, cuts, n_quant)
    finite = np.isfinite(kl)
    best_i = n
    if finite.any():
        # the first minimum, as a scan with a strict `<` keeps it (rounding may split a tie between thresholds)
        low = kl[finite].min()
        best_i = int(cuts[np.flatnonzero(finite & (kl <= low + 1e-12 * max(1.0, abs(low))))[0]])
    t = float(a.edges[best_i])
    if one_sided:
        return h.lo, min(h.hi, t)
    return max(h.lo, -t), min(h.hi, t)


def _xlogx(x: np.ndarray) -> np.ndarray:
    """x log x, 0 at 0."""
    return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)


def _entropy_kls(hist: np.ndarray, cuts: np.ndarray, n_quant: int) -> np.ndarray:
    """KL(P_i || Q_i) for each threshold i of `cuts`, all at once from prefix sums ([thresholds, levels] arrays, not a
    loop over thresholds of arrays as long as each: 20 ms -> 1 ms a site at 2048 bins).

    P_i: the first i bins, the rest of the mass added to bin i - 1. Q_i: the i bins merged into `n_quant` levels
    (bin j in level (j * n_quant) // i), each level's mass spread evenly over its non-empty bins. With R = sum(P_i)
    (all the mass) and S = sum(Q_i) (the mass below i): KL = (sum p log p - sum p log q) / R + log(S / R), where
    sum p log q over bins j < i - 1 is sum over levels of mass log(mass / non-empty bins); infinite where bin i - 1
    is empty but the clipped tail is not (P has mass where Q has none); NaN where no mass lies below i (skipped)."""
    mass_below = np.concatenate([[0.0], np.cumsum(hist)])
    filled_below = np.concatenate([[0.0], np.cumsum(hist > 0)])
    plogp_below = np.concatenate([[0.0], np.cumsum(_xlogx(hist))])
    total = mass_below[-1]
    # level k of threshold i holds bins ceil(k i / n_quant) .. ceil((k + 1) i / n_quant) - 1
    edges = -(-(np.arange(n_quant + 1)[None, :] * cuts[:, None]) // n_quant)
    mass = mass_below[edges[:, 1:]] - mass_below[edges[:, :-1]]
    filled = filled_below[edges[:, 1:]] - filled_below[edges[:, :-1]]
    level_q = np.where(mass > 0, mass / np.maximum(filled, 1.0), 1.0)
    p_log_q = np.sum(np.where(mass > 0, mass * np.log(level_q), 0.0), axis=1)
    last = hist[cuts - 1]
    tail = total - mass_below[cuts]
    kept = mass_below[cuts]
    # bin i - 1 holds the tail as well in P: its p log p and p log q take the tail's share
    p_log_p = plogp_below[cuts - 1] + _xlogx(last + tail)
    p_log_q = p_log_q + np.where(tail > 0, tail * np.log(np.where(last > 0, level_q[:, -1], 1.0)), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = (p_log_p - p_log_q) / total + np.log(kept / total)
    kl = np.where((last <= 0) & (tail > 0), np.inf, kl)
    return np.where(kept > 0, kl, np.nan)


# Candidate clipping fractions of each side's extreme: dense near 1, reaching 1% for heavy tails.
_FRACTIONS = np.unique(np.concatenate([np.geomspace(0.01, 1.0, 96), np.linspace(0.5, 1.0, 64)]))


def _mse(h: Histogram, grid: Grid) -> tuple[float, float]:
    """Search for the range with the lowest expected squared error.

    Symmetric grids: one absmax over `_FRACTIONS`. Asymmetric: the best common fraction of
    both extremes, then coordinate descent on each side (a full 2-D grid costs 100x more
    for the same optimum on unimodal histograms).
    """
    lo_max, hi_max = min(h.lo, 0.0), max(h.hi, 0.0)
    if grid.symmetric or grid.kind != "int":
        a = max(-lo_max, hi_max) * _FRACTIONS
        errs = _mse_curve(h, grid, -a, a)
        best = float(a[int(np.argmin(errs))])
        return max(h.lo, -best), min(h.hi, best)
    k = int(np.argmin(_mse_curve(h, grid, lo_max * _FRACTIONS, hi_max * _FRACTIONS)))
    lo, hi = lo_max * _FRACTIONS[k], hi_max * _FRACTIONS[k]
    for _ in range(3):
        if hi_max > 0:
            his = hi_max * _FRACTIONS
            hi = float(his[int(np.argmin(_mse_curve(h, grid, np.full_like(his, lo), his)))])
        if lo_max < 0:
            los = lo_max * _FRACTIONS
            lo = float(los[int(np.argmin(_mse_curve(h, grid, los, np.full_like(los, hi))))])
    return max(h.lo, lo), min(h.hi, hi)


@dataclass(frozen=True)
class Calibrator:
    """A named calibrator: `range(hist, grid) -> (lo, hi)`. `auto` also says which one it picked."""

    name: str
    fn: Callable[[Histogram, Grid], tuple[float, float]]

    def range(self, hist: Any, grid: Grid) -> tuple[float, float]:
        h = histogram_of(hist)
        lo, hi = self.fn(h, grid)
        # never wider than the data (interpolation inside a histogram bin can overshoot the exact extremes)
        lo, hi = min(max(lo, h.lo), h.hi), max(min(hi, h.hi), h.lo)
        return float(min(lo, hi)), float(max(lo, hi))


def _auto_candidates() -> list[Calibrator]:
    return [parse_calibrator(n) for n in CANDIDATES]


def _auto(h: Histogram, grid: Grid) -> tuple[float, float]:
    return calibrate_range(h, grid, "auto")[:2]


CALIBRATORS: Mapping[str, Callable[[float | None], Callable[[Histogram, Grid], tuple[float, float]]]] = {
    "minmax": lambda p: _minmax,
    "percentile": lambda p: _percentile(99.99 if p is None else p),
    "entropy": lambda p: _entropy,
    "mse": lambda p: _mse,
    "auto": lambda p: _auto,
    # `search` picks per site the candidate giving the best FFN OUTPUT error on calibration
    # tokens (ffnquant.quantization.search_calibrators); from a histogram alone it is `auto`.
    "search": lambda p: _auto,
}

# The candidates `auto` compares on the histogram and `search` on the FFN output.
CANDIDATES = ("minmax", "percentile:99.9", "percentile:99.99", "percentile:99.999", "entropy", "mse")


def calibrator_names() -> list[str]:
    return list(CALIBRATORS)


def parse_calibrator(name: str | Calibrator) -> Calibrator:
    """A calibrator from its name; `percentile:P` sets the percentile (0 < P <= 100). Unknown names list the valid ones."""
    if isinstance(name, Calibrator):
        return name
    text = str(name).strip().lower()
    key, _, arg = text.partition(":")
    if key not in CALIBRATORS:
        raise unknown_choice("calibrator", name, [*CALIBRATORS, "percentile:P"])
    param = None
    if arg:
        if key != "percentile":
            raise FFNQuantError(f"calibrator {key!r} takes no parameter (got {text!r})")
        try:
            param = float(arg)
        except ValueError:
            raise FFNQuantError(f"percentile must be a number, got {arg!r}") from None
        if not 0 < param <= 100:
            raise FFNQuantError(f"percentile must be in (0, 100], got {param}")
    canonical = key if param is None else f"{key}:{param:g}"
    return Calibrator(canonical, CALIBRATORS[key](param))


def calibrate_range(hist: Any, grid: Grid, calibrator: str | Calibrator) -> tuple[float, float, str, float]:
    """(lo, hi, calibrator actually used, expected MSE) for one site; `auto` tries each candidate and keeps the best."""
    h = histogram_of(hist)
    cal = parse_calibrator(calibrator)
    if cal.name not in ("auto", "search"):
        lo, hi = cal.range(h, grid)
        return lo, hi, cal.name, expected_mse(h, grid, lo, hi)
    best: tuple[float, float, str, float] | None = None
    for cand in _auto_candidates():
        lo, hi = cand.range(h, grid)
        err = expected_mse(h, grid, lo, hi)
        if best is None or err < best[3]:
            best = (lo, hi, cand.name, err)
    assert best is not None
    return best
