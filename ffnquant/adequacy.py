"""Calibration adequacy: does a calibration set pin down the static activation ranges?

Per activation site (`input`, `hidden`) of an FFN, returned as data: **convergence** (bootstrap resamples of
n calibration sequences, with replacement, calibrated with the user's calibrator: from how many sequences the
chosen range stops moving, `site_convergence`); **held-out clipping** (the share of a held-out text's values
outside the range chosen on the whole calibration set, next to the calibration set's own, `clip_stats`);
**domain shift** (ranges from text A, the calibration set, against ranges from a text B of another domain,
both measured on B: clip rates and the layer's output SQNR under the static scheme, `layer_adequacy`).

Cheap by construction: one `StreamingHistogram` per sequence and site is built once; a resample's
histogram is the sum of its sequences' counts folded onto the widest range among them, which is
exactly the histogram of their concatenated values (the merge rule of `ffnquant.numerics.histogram`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from .errors import FFNQuantError
from .hf.capture import TEXT_SPLITS, default_text_path, iter_captured, load_tokenizer, model_text_batches, text_label
from .hf.checkpoint import inspect_model, load_ffn_layers
from .hf.inputs import EvalSettings, fit_settings, token_budget
from .hf.layerwise import capture_layer_inputs
from .numerics.accuracy import sqnr_db
from .numerics.calibrate import Calibrator, Grid, Histogram, calibrate_range, parse_calibrator
from .methods.fakequant import ACT_SITES, QuantizedFFN, quantize_model, site_ranges
from .numerics.histogram import DEFAULT_BINS, StreamingHistogram, as_float_tensor, non_finite_error
from .schemes import Scheme, check_scheme_fits, get_scheme

__all__ = [
    "DEFAULT_BOOTSTRAP", "DEFAULT_TOLERANCE", "SiteSamples", "SizeSpread", "Convergence", "ClipStats",
    "SiteAdequacy", "LayerAdequacy", "scheme_grid", "default_sizes", "site_convergence", "clip_limits",
    "clip_stats", "site_values", "verdict", "layer_adequacy", "summarize", "model_adequacy",
]

DEFAULT_BOOTSTRAP = 50
DEFAULT_TOLERANCE = 0.05
# Held-out clipping worth a remark: this many times the calibration set's own clip rate and more than
# one value in 10,000 above it (rarer clipping costs no SQNR one could see next to int8 rounding).
CLIP_REMARK_FACTOR = 3.0
CLIP_REMARK_FLOOR = 1e-4
# Calibrators whose range depends on a histogram only through its non-empty bins and the exact extremes
# (mse sums count-weighted errors over bins; minmax reads the extremes): for them runs of empty bins are
# merged into one, the same answer at a fraction of the cost on heavy-tailed sites, whose few occupied
# bins sit among thousands of empty ones. Percentile and entropy re-bin |x| by bin count: never merged.
_SPARSE_EXACT = frozenset({"mse", "minmax"})


# --- per-sequence histograms and their resamples -------------------------------------------------


class SiteSamples:
    """One site's calibration values, one histogram per sequence (built once).

    `histogram(indices)` is the histogram of the chosen sequences' values together (repeats count
    twice), equal bin for bin to a `StreamingHistogram` of their concatenation, with its exact extremes.
    """

    def __init__(self, sequences: Sequence[torch.Tensor | np.ndarray], bins: int = DEFAULT_BINS) -> None:
        if len(sequences) == 0:
            raise FFNQuantError("no calibration sequences: at least one is needed")
        self.bins = bins
        self._hists: list[StreamingHistogram] = []
        mins, maxs, exps, sizes = [], [], [], []  # per sequence
        for i, x in enumerate(sequences):
            x = as_float_tensor(x).reshape(-1)
            if x.numel() == 0:
                raise FFNQuantError(f"calibration sequence {i} has no values")
            lo, hi = (float(v) for v in torch.aminmax(x))
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise non_finite_error(x, f"calibration sequence {i}")
            h = StreamingHistogram(bins).update(x, absmax=max(-lo, hi))
            self._hists.append(h)
            mins.append(lo), maxs.append(hi), sizes.append(x.numel())
            exps.append(math.frexp(h.range_max)[1] - 1)  # range_max is exactly 2**exp
        self.mins, self.maxs = np.array(mins), np.array(maxs)
        self.exps = np.array(exps, dtype=np.int64)
        self.sizes = np.array(sizes, dtype=np.int64)
        self._folded: dict[tuple[int, int], np.ndarray] = {}
        self.n = len(self._hists)  # sequences

    def _counts_at(self, i: int, exp: int) -> np.ndarray:
        """Sequence i's counts on the bins of range 2**exp (>= its own): merged with a one-value histogram of
        that range, whose own count is then taken off again (merging folds exactly; the anchor's bins do not move)."""
        key = (i, exp)
        if key not in self._folded:
            anchor = StreamingHistogram(self.bins).update(torch.tensor([math.ldexp(1.0, exp - 1)]))
            self._folded[key] = self._hists[i].merge(anchor).counts - anchor.counts
        return self._folded[key]

    def histogram(self, indices: Iterable[int] | None = None) -> Histogram:
        """The histogram of the values of sequences `indices` (default all), repeats included."""
        idx = np.arange(self.n) if indices is None else np.asarray(list(indices), dtype=np.int64)
        if idx.size == 0:
            raise FFNQuantError("a resample needs at least one sequence")
        mult = np.bincount(idx, minlength=self.n)
        used = np.flatnonzero(mult)
        exp = int(self.exps[used].max())
        counts = np.zeros(self.bins, dtype=np.int64)
        for i in used:
            counts += mult[i] * self._counts_at(int(i), exp)
        r = math.ldexp(1.0, exp)
        return Histogram(counts, np.linspace(-r, r, self.bins + 1), float(self.mins[used].min()),
                         float(self.maxs[used].max()))


def _compact(h: Histogram) -> Histogram:
    """`h` with every run of empty bins merged into one empty bin and the empty ends dropped (exact extremes kept)."""
    nz = h.counts > 0
    keep = np.zeros(nz.size + 1, dtype=bool)
    keep[:-1] |= nz
    keep[1:] |= nz
    edges = np.flatnonzero(keep)  # both edges of every occupied bin: an occupied bin stays exactly itself
    counts = np.add.reduceat(h.counts, edges[:-1])
    return Histogram(counts, h.edges[edges], h.lo, h.hi)


def _calibrate(h: Histogram, grid: Grid, cal: Calibrator) -> tuple[float, float, str]:
    lo, hi, used, _ = calibrate_range(_compact(h) if cal.name in _SPARSE_EXACT else h, grid, cal)
    return lo, hi, used


# --- convergence --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeSpread:
    """The ranges chosen on `resamples` bootstrap resamples of n sequences, relative to the full-set range.

    `width_*` are quantiles of the width of the range's clipping limits (`clip_limits`: what sets the
    quantization step) over the full set's; `lo_median` / `hi_median` the median bounds over the full set's (None where that is 0);
    `spread` = (p95 - p5) / median of the width; `distinct` resamples were calibrated (repeats reused).
    """

    n: int
    resamples: int
    distinct: int
    width_p5: float | None
    width_median: float | None
    width_p95: float | None
    lo_median: float | None
    hi_median: float | None
    spread: float

    def to_dict(self) -> dict[str, Any]:  # an unbounded spread (median width 0) is None in JSON
        return {**self.__dict__, "spread": self.spread if math.isfinite(self.spread) else None}


@dataclass(frozen=True)
class Convergence:
    """How the calibrated range of one site moves with the number of calibration sequences. `converged_at`: the
    smallest n from which the spread stays under `tolerance` at every larger size, None when over it at the full size."""

    calibrator: str
    calibrator_used: str
    n_sequences: int
    n_values: int
    lo: float
    hi: float
    tolerance: float
    bootstrap: int
    seed: int
    rows: tuple[SizeSpread, ...]
    converged_at: int | None

    @property
    def final_spread(self) -> float:
        """The spread of the range at the full size (resamples of all `n_sequences`)."""
        return self.rows[-1].spread

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "rows"}
        final = self.final_spread if math.isfinite(self.final_spread) else None
        return {**out, "final_spread": final, "rows": [r.to_dict() for r in self.rows]}


def scheme_grid(scheme: Scheme | str) -> Grid:
    """The activation grid a static scheme calibrates for; a scheme without static ranges is refused."""
    s = get_scheme(scheme)
    if not s.static_activations:
        raise FFNQuantError(f"scheme {s.name!r} has no static activation ranges: adequacy is about calibrated "
                            "ranges; choose a scheme with static activations such as w8a8")
    return Grid.for_act(s.act_dtype, bool(s.act_symmetric))


def default_sizes(n_sequences: int) -> list[int]:
    """1, 2, 4, ... below `n_sequences`, then `n_sequences` itself."""
    return [2**k for k in range((n_sequences - 1).bit_length())] + [n_sequences]


def _check_options(calibrator: str | Calibrator, bootstrap: int, tolerance: float, seed: int) -> Calibrator:
    cal = parse_calibrator(calibrator)
    if cal.name == "search":
        raise FFNQuantError("calibrator 'search' chooses per site by the FFN's output on calibration tokens; adequacy "
                            "re-calibrates resamples from histograms: choose auto or one calibrator (mse, minmax, ...)")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap <= 0:
        raise FFNQuantError(f"bootstrap resamples must be a positive integer, got {bootstrap!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise FFNQuantError(f"tolerance must be a fraction in (0, 1), got {tolerance!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise FFNQuantError(f"seed must be an integer, got {seed!r}")
    return cal


def _sizes(sizes: Sequence[int] | None, n_sequences: int) -> list[int]:
    if sizes is None:
        return default_sizes(n_sequences)
    out = set()
    for n in sizes:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= n_sequences:
            raise FFNQuantError(f"resample sizes must be integers from 1 to the {n_sequences} sequences, got {n!r}")
        out.add(int(n))
    return sorted(out | {n_sequences})  # the full size always: the verdict is read there


def _relative(x: float, full: float) -> float | None:
    return float(x / full) if full != 0 else None


def _convergence(samples: SiteSamples, cal: Calibrator, grid: Grid, sizes: Sequence[int] | None, bootstrap: int,
                 seed: int, tolerance: float) -> Convergence:
    m = samples.n
    full_lo, full_hi, used = _calibrate(samples.histogram(), grid, cal)
    def span(lo: float, hi: float) -> float:  # the width between the clipping limits: what sets the step
        a, b = clip_limits(lo, hi, grid)
        return b - a

    width = span(full_lo, full_hi)
    rng = np.random.default_rng(seed)
    cache: dict[tuple[int, ...], tuple[float, float]] = {}
    rows = []
    for n in _sizes(sizes, m):
        los, his, keys = [], [], set()
        for draw in rng.integers(0, m, size=(bootstrap, n)):
            key = tuple(sorted(int(i) for i in draw))  # a resample is a multiset: order changes no histogram
            keys.add(key)
            if key not in cache:
                cache[key] = _calibrate(samples.histogram(key), grid, cal)[:2]
            los.append(cache[key][0]), his.append(cache[key][1])
        widths = np.array([span(lo, hi) for lo, hi in zip(los, his)])
        p5, med, p95 = (float(v) for v in np.percentile(widths, [5, 50, 95]))
        spread = (p95 - p5) / med if med > 0 else (0.0 if p95 == p5 else math.inf)
        rows.append(SizeSpread(n, bootstrap, len(keys), _relative(p5, width), _relative(med, width),
                               _relative(p95, width), _relative(float(np.median(los)), full_lo),
                               _relative(float(np.median(his)), full_hi), float(spread)))
    converged_at = None
    for row in reversed(rows):
        if row.spread >= tolerance:
            break
        converged_at = row.n
    return Convergence(cal.name, used, m, int(samples.sizes.sum()), full_lo, full_hi, float(tolerance), bootstrap,
                       seed, tuple(rows), converged_at)


def site_convergence(sequences: Sequence[torch.Tensor | np.ndarray] | SiteSamples, calibrator: str | Calibrator,
                     grid: Grid, sizes: Sequence[int] | None = None, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                     tolerance: float = DEFAULT_TOLERANCE, bins: int = DEFAULT_BINS) -> Convergence:
    """How the range `calibrator` chooses for one site moves with the number of calibration sequences.

    `sequences`: the site's values per sequence ([seq_tokens, channels] each), or their `SiteSamples`.
    For each n of `sizes` (default 1, 2, 4, ... and all), `bootstrap` resamples of n sequences drawn with
    replacement (seeded) are calibrated; see `SizeSpread` and `Convergence` for what is reported.
    """
    cal = _check_options(calibrator, bootstrap, tolerance, seed)
    samples = sequences if isinstance(sequences, SiteSamples) else SiteSamples(sequences, bins)
    return _convergence(samples, cal, grid, sizes, bootstrap, seed, tolerance)


# --- clipping ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipStats:
    """Values of one site against the clipping limits of a range: `clip_rate`, the fraction of values outside;
    `token_clip_rate`, of tokens (rows) with a value outside; `absmax_beyond`, how far the values reach past the
    limits as a fraction of the limit they pass (0.0 when all are inside, 1.0 = twice the limit; None past a 0)."""

    n_values: int
    n_tokens: int
    clip_rate: float
    token_clip_rate: float
    absmax_beyond: float | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def clip_limits(lo: float, hi: float, grid: Grid) -> tuple[float, float]:
    """The values a range [lo, hi] really clips at on `grid`: zero is always on the grid, and a symmetric
    grid mirrors the wider side."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if grid.symmetric or grid.kind != "int":
        a = max(-lo, hi)
        return -a, a
    return lo, hi


def clip_stats(values: torch.Tensor, lo: float, hi: float) -> ClipStats:
    """`ClipStats` of `values` ([tokens, channels]; a 1-D tensor is one token) against the limits [lo, hi]."""
    x = as_float_tensor(values)
    x = x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)
    if x.numel() == 0:
        raise FFNQuantError("no values to measure clipping on")
    outside = (x < lo) | (x > hi)
    x_lo, x_hi = (float(v) for v in torch.aminmax(x))
    beyond: float | None = 0.0
    for extreme, limit, past in ((x_hi, hi, x_hi > hi), (x_lo, lo, x_lo < lo)):
        if past and limit == 0:
            beyond = None  # values on a side the range does not cover at all
            break
        if past:
            beyond = max(beyond, extreme / limit - 1.0)
    return ClipStats(x.numel(), x.shape[0], float(outside.sum()) / x.numel(),
                     float(outside.any(dim=-1).sum()) / x.shape[0], beyond)


# --- one FFN layer -------------------------------------------------------------------------------


def site_values(ffn: Any, x: torch.Tensor, sites: Sequence[str] = ACT_SITES) -> dict[str, torch.Tensor]:
    """The values each of `sites` sees ([tokens, channels]) when `ffn` runs on x [tokens, d_model] (hooks on `ffn.taps`)."""
    got: dict[str, torch.Tensor] = {}
    handles: list[Any] = []
    try:  # hooks removed also on error
        for s in sites:
            handles.append(ffn.taps[s].register_forward_hook(
                lambda mod, inp, out, s=s: got.__setitem__(s, out.detach().reshape(-1, out.shape[-1]).float())))
        with torch.no_grad():
            ffn(as_float_tensor(x))
    finally:
        for h in handles:
            h.remove()
    return got


@dataclass(frozen=True)
class SiteAdequacy:
    """One site's answer: convergence, clipping on calibration and held-out values, shift, and the verdict.

    `shift`: {lo, hi (the range chosen on text B), clip_rate_a (A's range on B), clip_rate_b (B's range on B),
    clip_rate_delta (a - b)}, or None without a shift text.
    """

    site: str
    convergence: Convergence
    calibration: ClipStats
    held_out: ClipStats
    shift: Mapping[str, float] | None
    stable: bool
    clip_remark: str | None
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        parts = {k: getattr(self, k).to_dict() for k in ("convergence", "calibration", "held_out")}
        return {**self.__dict__, **parts, "shift": None if self.shift is None else dict(self.shift)}


@dataclass(frozen=True)
class LayerAdequacy:
    """Every activation site of one FFN layer, and the layer's output SQNR under the static scheme: on the
    held-out tokens with the calibration set's ranges, and on the shift text B with ranges from A and from B
    (`shift_sqnr_delta_db` = B's minus A's: what calibrating on the other domain costs)."""

    scheme: str
    calibrator: str
    sites: Mapping[str, SiteAdequacy]
    n_sequences: int
    calib_tokens: int
    eval_tokens: int
    shift_tokens: int | None
    held_out_sqnr_db: float
    shift_sqnr_a_db: float | None
    shift_sqnr_b_db: float | None

    @property
    def shift_sqnr_delta_db(self) -> float | None:
        if self.shift_sqnr_a_db is None or self.shift_sqnr_b_db is None:
            return None
        return self.shift_sqnr_b_db - self.shift_sqnr_a_db

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "sites"}
        return {**out, "shift_sqnr_delta_db": self.shift_sqnr_delta_db,
                "sites": {s: a.to_dict() for s, a in self.sites.items()}}


def verdict(conv: Convergence, calibration: ClipStats, held_out: ClipStats) -> tuple[bool, str | None, str]:
    """(stable, clip remark or None, the plain verdict) of one site."""
    m = conv.n_sequences
    if conv.converged_at is not None:
        text = f"ranges stable from {conv.converged_at} sequence{'s' * (conv.converged_at != 1)} (of {m})"
    else:
        moves = f"by {conv.final_spread:.0%}" if math.isfinite(conv.final_spread) else "about a median width of 0"
        text = f"needs more data: the range still moves {moves} at {m} sequences"
    remark = None
    ours, theirs = calibration.clip_rate, held_out.clip_rate
    if theirs > CLIP_REMARK_FACTOR * ours and theirs - ours > CLIP_REMARK_FLOOR:
        remark = (f"held-out values clip {theirs / ours:.0f}x as often as calibration values ({theirs:.3%} vs "
                  f"{ours:.3%})" if ours > 0 else
                  f"held-out values clip ({theirs:.3%} of them) where no calibration value does")
    return conv.converged_at is not None, remark, text if remark is None else f"{text}; {remark}"


def _ranges(samples: SiteSamples, site: str, scheme: Scheme, cal: Calibrator):
    """The `fakequant.SiteRange` (qparams included) of all of `samples`, as quantize_model takes it."""
    h = samples.histogram()
    return site_ranges({site: _compact(h) if cal.name in _SPARSE_EXACT else h}, scheme, cal.name, (site,))[site]


def _sqnr(ref: torch.Tensor, q: Any, x: torch.Tensor) -> float:
    with torch.no_grad():
        return sqnr_db(ref, q(x))


def layer_adequacy(ffn: Any, calib_sequences: Sequence[torch.Tensor], eval_tokens: torch.Tensor,
                   scheme: Scheme | str = "w8a8", calibrator: str | Calibrator = "mse",
                   shift_tokens: torch.Tensor | None = None, bootstrap: int = DEFAULT_BOOTSTRAP,
                   sizes: Sequence[int] | None = None, seed: int = 0, tolerance: float = DEFAULT_TOLERANCE,
                   bins: int = DEFAULT_BINS) -> LayerAdequacy:
    """Calibration adequacy of one FFN layer under a static `scheme`.

    `calib_sequences`: the FFN's calibration inputs per sequence ([seq_tokens, d_model] each);
    `eval_tokens`: held-out inputs [tokens, d_model] from another text; `shift_tokens`: inputs from a text
    of another domain (B), or None. Site values come from running `ffn` with hooks on its taps.
    """
    cal = _check_options(calibrator, bootstrap, tolerance, seed)
    sch = get_scheme(scheme)
    grid = scheme_grid(sch)
    check_scheme_fits(sch, ffn.spec)
    seqs = [as_float_tensor(s).reshape(-1, ffn.spec.d_model) for s in calib_sequences]
    if not seqs:
        raise FFNQuantError("no calibration sequences: at least one is needed")
    lengths, calib = [s.shape[0] for s in seqs], torch.cat(seqs)
    eval_x = as_float_tensor(eval_tokens).reshape(-1, ffn.spec.d_model)
    shift_x = None if shift_tokens is None else as_float_tensor(shift_tokens).reshape(-1, ffn.spec.d_model)
    if eval_x.shape[0] == 0 or (shift_x is not None and shift_x.shape[0] == 0):
        raise FFNQuantError("held-out and shift inputs need at least one token each")
    taps = (*ACT_SITES, "output")  # the float output too: the reference of the SQNRs
    values = site_values(ffn, calib, ACT_SITES)
    eval_values = site_values(ffn, eval_x, taps)
    shift_values = site_values(ffn, shift_x, taps) if shift_x is not None else None
    ranges_a, ranges_b, sites = {}, {}, {}
    for site in ACT_SITES:
        samples = SiteSamples(list(torch.split(values[site], lengths)), bins)
        conv = _convergence(samples, cal, grid, sizes, bootstrap, seed, tolerance)
        ranges_a[site] = _ranges(samples, site, sch, cal)
        lo, hi = clip_limits(conv.lo, conv.hi, grid)
        ours, held = clip_stats(values[site], lo, hi), clip_stats(eval_values[site], lo, hi)
        shift = None
        if shift_values is not None:
            rb = ranges_b[site] = _ranges(SiteSamples([shift_values[site]], bins), site, sch, cal)
            a_on_b = clip_stats(shift_values[site], lo, hi).clip_rate
            b_on_b = clip_stats(shift_values[site], *clip_limits(rb.lo, rb.hi, grid)).clip_rate
            shift = {"lo": rb.lo, "hi": rb.hi, "clip_rate_a": a_on_b, "clip_rate_b": b_on_b,
                     "clip_rate_delta": a_on_b - b_on_b}
        stable, remark, text = verdict(conv, ours, held)
        sites[site] = SiteAdequacy(site, conv, ours, held, shift, stable, remark, text)
    q = quantize_model(ffn, sch, site_range_cache=ranges_a)
    held_db = _sqnr(eval_values["output"], q, eval_x)
    a_db = b_db = None
    if shift_values is not None:
        a_db = _sqnr(shift_values["output"], q, shift_x)
        q.remove_hooks()  # the same quantized weights, B's ranges on the activations
        qb = QuantizedFFN(q.model, sch, ranges_b, q.quantized_weights, q.quantized_sites)
        b_db = _sqnr(shift_values["output"], qb, shift_x)
        qb.remove_hooks()
    return LayerAdequacy(sch.name, cal.name, sites, len(lengths), int(calib.shape[0]), int(eval_x.shape[0]),
                         None if shift_x is None else int(shift_x.shape[0]), held_db, a_db, b_db)


# --- a whole model -------------------------------------------------------------------------------


def summarize(layers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts over every (layer, site) of `model_adequacy`'s layer rows: how many are stable and from how
    many sequences, which need more data ('L3 hidden'), which clip far more on held-out text, the worst shifts."""
    named = [(f"{layer['label']} {site}", a) for layer in layers for site, a in layer["sites"].items()]
    from_n = [a["convergence"]["converged_at"] for _, a in named if a["stable"]]
    shifts = sorted(((layer["shift_sqnr_delta_db"], layer["label"]) for layer in layers
                     if layer.get("shift_sqnr_delta_db") is not None), reverse=True)
    return {
        "n_sites": len(named), "n_stable": len(from_n),
        "stable_from_max": max(from_n) if from_n else None,
        "stable_from_median": float(np.median(from_n)) if from_n else None,
        "n_sequences": max((layer["n_sequences"] for layer in layers), default=0),
        "needs_more_data": [name for name, a in named if not a["stable"]],
        "needs_more_data_by_site": {site: sum(1 for name, a in named if name.endswith(f" {site}") and not a["stable"])
                                    for site in ACT_SITES},
        "held_out_clipping": [name for name, a in named if a["clip_remark"]],
        "largest_shift_loss": [{"label": label, "sqnr_delta_db": d} for d, label in shifts[:3]],
    }


def _shift_path(shift_text: str | os.PathLike | None):
    """(path, label) of the shift text: a shipped sample by name ('code'), else the file(s) given."""
    if shift_text is None:
        return None, None
    if isinstance(shift_text, str) and shift_text in TEXT_SPLITS and not os.path.exists(shift_text):
        return default_text_path(shift_text), f"ffnquant/data/{TEXT_SPLITS[shift_text]}"
    return shift_text, text_label(shift_text, "shift")


def _units(lengths: Sequence[int], seq_len: int) -> list[int]:
    """The resampled units: the text's windows, a short last one joined to the one before (units of about one size)."""
    units = list(lengths)
    if len(units) > 1 and units[-1] < seq_len:
        units[-2:] = [units[-2] + units[-1]]
    return units


def _sequences(x: torch.Tensor, units: Sequence[int], seq_len: int) -> tuple[list[torch.Tensor], str]:
    """A layer's calibration rows cut into the `units` they came from; rows a router picked (experts) cannot be
    traced to windows and are cut into runs of `seq_len` rows instead (said in the note)."""
    if x.shape[0] == sum(units):
        return list(torch.split(x, list(units))), f"windows of {seq_len} tokens (a short last one joins the one before)"
    return list(torch.split(x, seq_len)), f"runs of {seq_len} routed rows (an expert's rows are not whole windows)"


def model_adequacy(model_dir: str | os.PathLike, layers: str | int | list[int] | None = "all",
                   text: str | os.PathLike | None = None, eval_text: str | os.PathLike | None = None,
                   shift_text: str | os.PathLike | None = "code", calibrator: str = "mse", scheme: str = "w8a8",
                   bootstrap: int = DEFAULT_BOOTSTRAP, sizes: Sequence[int] | None = None, seed: int = 0,
                   tolerance: float = DEFAULT_TOLERANCE, settings: Any = None, allow_pickle: bool = False,
                   progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """`layer_adequacy` of every selected FFN of a local Hugging Face model, JSON-able.

    The model runs on `text` (calibration, default the shipped sample; cut into `settings.seq_len`-token
    windows, the bootstrap's sequences), `eval_text` (held out, default the other shipped book) and
    `shift_text` (another domain: 'code' is the shipped Python sample, None skips the shift). Every option
    and text is checked before the model loads. `progress(message, done, total)` after each batch and layer.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    cal = _check_options(calibrator, bootstrap, tolerance, seed)
    sch = get_scheme(scheme)
    scheme_grid(sch)
    info = inspect_model(model_dir, allow_pickle=allow_pickle)
    check_scheme_fits(sch, info.spec)
    settings = fit_settings(info, settings if settings is not None else EvalSettings())
    shift_path, shift_label = _shift_path(shift_text)
    shift_ids = None
    if shift_path is not None:  # read, tokenized and checked before the model loads
        shift_ids = model_text_batches(info, load_tokenizer(info.path), shift_path, "shift", settings.seq_len,
                                       settings.batch_size, settings.max_eval_tokens)
    hf_layers = load_ffn_layers(info, layers, allow_pickle=allow_pickle)
    inputs = capture_layer_inputs(info, hf_layers, text=text, eval_text=eval_text,
                                  calib_tokens=settings.max_calib_tokens, eval_tokens=settings.max_eval_tokens,
                                  settings=settings, allow_pickle=allow_pickle, progress=progress)
    shift: dict[str, list[torch.Tensor]] = {layer.label: [] for layer in hf_layers}
    if shift_ids is not None:
        for i, batch in enumerate(iter_captured(inputs.model, info, [layer.info for layer in hf_layers], shift_ids)):
            for label, x in batch.items():
                shift[label].append(x)
            if progress is not None:
                progress(f"capture shift inputs: batch {i + 1}/{len(shift_ids)}", i + 1, len(shift_ids))
    inputs.model = None  # the transformers model is no longer needed: free it before measuring
    units = _units([int(b.shape[1]) for b in inputs.calib_batches or [] for _ in range(b.shape[0])], settings.seq_len)
    t_capture, c_capture = time.perf_counter(), time.process_time()
    rows = []
    for k, layer in enumerate(hf_layers):
        seqs, note = _sequences(inputs.calib[layer.label], units, settings.seq_len)
        shift_x = torch.cat(shift[layer.label]) if shift[layer.label] else None
        res = layer_adequacy(layer.ffn, seqs, inputs.eval[layer.label], sch, cal, shift_x, bootstrap, sizes, seed,
                             tolerance, settings.bins)
        rows.append({"label": layer.label, "index": layer.index, "expert": layer.expert, "name": layer.name,
                     "sequences": note, "calib_borrowed": layer.label in inputs.calib_borrowed, **res.to_dict()})
        if progress is not None:
            progress(f"adequacy: {layer.label}", k + 1, len(hf_layers))
    t_end, c_end = time.perf_counter(), time.process_time()
    texts = {"calibration": {"source": inputs.calibration_source, "tokens": inputs.budgets.get("calibration"),
                             "sequences": len(units), "seq_len": settings.seq_len},
             "evaluation": {"source": inputs.evaluation_source, "tokens": inputs.budgets.get("evaluation")},
             "shift": None if shift_ids is None else {
                 "source": shift_label,
                 "tokens": token_budget("shift", settings.max_eval_tokens, shift_ids, shift_label)}}
    return {
        "model": {k: v for k, v in info.to_dict().items() if k != "layers"},
        "options": {"scheme": sch.name, "calibrator": cal.name, "bootstrap": bootstrap, "sizes": sizes, "seed": seed,
                    "tolerance": tolerance, "bins": settings.bins, "seq_len": settings.seq_len,
                    "clip_remark_factor": CLIP_REMARK_FACTOR, "clip_remark_floor": CLIP_REMARK_FLOOR},
        "texts": texts,
        "layers": rows,
        "summary": summarize(rows),
        # wall time and this process's CPU time (all its threads): the second does not grow on a busy machine
        "seconds": {"load_and_capture": t_capture - t0, "measure": t_end - t_capture, "total": t_end - t0,
                    "cpu_load_and_capture": c_capture - c0, "cpu_measure": c_end - c_capture, "cpu_total": c_end - c0},
    }
