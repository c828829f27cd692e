"""Recommendations from measured numbers: Pareto fronts, the fastest scheme meeting an
accuracy target, and findings across variants.

Pure functions on plain numbers (no measuring, no printing): the run collects accuracy
and latency, these functions decide, and every sentence they return quotes the figures
it was derived from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from ..errors import FFNQuantError

__all__ = [
    "DEFAULT_TARGET_DB",
    "Point",
    "Recommendation",
    "join_points",
    "pareto_front",
    "beats",
    "recommend",
    "recommend_all",
    "crest_cost_finding",
]

# SQNR 30 dB = output error at about 3% of the signal's RMS: the usual "int8 is safe" bar.
DEFAULT_TARGET_DB = 30.0


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class Point:
    """One measured case: a scheme's accuracy and its median latency on a runtime at M tokens.

    `sqnr_db=None` marks the float reference itself (exact by definition). `p10_s` / `p90_s`
    are the latency's 10th and 90th percentiles (the bench's LatencyStats): a scheme is only
    called faster than the baseline when its p90 is below the baseline's p10. Without them the
    medians are compared.
    """

    variant: str
    scheme: str
    runtime: str
    tokens: int
    latency_s: float
    sqnr_db: float | None
    label: str = ""
    p10_s: float | None = None
    p90_s: float | None = None
    suspect: str | None = None  # why its timing is not to be trusted (the bench's flag): never recommended

    def __post_init__(self) -> None:
        if not _positive(self.latency_s):
            raise FFNQuantError(f"latency of {self.scheme} on {self.runtime} must be a positive number, got {self.latency_s!r}")
        for name in ("p10_s", "p90_s"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise FFNQuantError(f"{name} of {self.scheme} on {self.runtime} must be a positive number or None, got {value!r}")
        if self.p10_s is not None and self.p90_s is not None and self.p10_s > self.p90_s:
            raise FFNQuantError(f"latency percentiles of {self.scheme} on {self.runtime}: p10 {self.p10_s!r} exceeds p90 {self.p90_s!r}")
        if self.sqnr_db is not None and not isinstance(self.sqnr_db, (int, float)):
            raise FFNQuantError(f"SQNR of {self.scheme} must be a number or None, got {self.sqnr_db!r}")
        if not self.label:
            object.__setattr__(self, "label", self.scheme)

    @property
    def fast_end(self) -> float:
        """The low end of the measured spread (p10, else the median)."""
        return self.p10_s if self.p10_s is not None else self.latency_s

    @property
    def slow_end(self) -> float:
        """The high end of the measured spread (p90, else the median)."""
        return self.p90_s if self.p90_s is not None else self.latency_s

    @property
    def accuracy(self) -> float:
        """SQNR with the exact reference ranked above everything."""
        return math.inf if self.sqnr_db is None else float(self.sqnr_db)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Point":
        """The point `to_dict` wrote (as stored in a run report's `timing.points`)."""
        return cls(**dict(data))


def join_points(cases: Iterable[Mapping[str, Any]], rows: Iterable[Mapping[str, Any]], baseline: str) -> list[Point]:
    """The latency cases that ran, each paired with the accuracy row of its (variant, scheme): one Point per case.

    The baseline is exact (SQNR None); a case without an accuracy figure is left out. Where a case disagrees
    with the reference and carries its own SQNR (a saturating int8 kernel computes something other than the
    recipe), what that runtime delivers is its own figure, not the recipe's.
    """
    acc = {(r["variant"], r["scheme"]): r for r in rows}
    points = []
    for c in cases:
        if c.get("error") is not None or not c.get("median_s"):
            continue
        row = acc.get((c["variant"], c["scheme"]))
        if c["scheme"] == baseline:
            sqnr = None
        elif row is not None and row.get("status") == "ok" and row.get("sqnr_db") is not None:
            own = c.get("sqnr_db") if c.get("disagrees_with_reference") else None
            sqnr = float(row["sqnr_db"] if own is None else own)
        else:
            continue
        points.append(Point(c["variant"], c["scheme"], c["runtime"], c["tokens"], float(c["median_s"]), sqnr,
                            row["label"] if row else c["scheme"], p10_s=c.get("p10_s") or None,
                            p90_s=c.get("p90_s") or None, suspect=c.get("suspect")))
    return points


@dataclass(frozen=True)
class Recommendation:
    """The choice for one (variant, runtime, tokens), with the one-line reason."""

    variant: str
    runtime: str
    tokens: int
    target_db: float
    choice: str | None  # scheme name, None when there were no measurements at all
    label: str | None
    sqnr_db: float | None
    latency_s: float | None
    baseline: str
    speedup: float | None  # baseline latency / chosen latency, None without a baseline
    meets_target: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt_db(p: Point) -> str:
    return "exact" if p.sqnr_db is None else f"{p.sqnr_db:.1f} dB"


def _fmt_ratio(r: float) -> str:
    # near 1 one decimal would print a measurable 4% as "1.0x"
    return f"{r:.2f}x" if r < 1.1 else f"{r:.1f}x"


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def beats(p: Point, base: Point) -> bool:
    """True when `p` is faster than `base` beyond the measured spread: p's p90 below base's p10.

    Timings of two cases overlap by noise (other processes, frequency scaling); a median a few
    percent lower inside that overlap is no reason to quantize. Medians stand in for missing percentiles.
    """
    return p.slow_end < base.fast_end


def pareto_front(points: Iterable[Point]) -> list[Point]:
    """Points no other point beats on both latency (lower) and accuracy (higher); sorted by latency.

    A point is dominated when another is at least as fast and at least as accurate and strictly
    better in one of the two.
    """
    pts = sorted(points, key=lambda p: (p.latency_s, -p.accuracy, p.scheme))
    front: list[Point] = []
    best_acc = -math.inf
    for p in pts:
        # Sorted by latency, so p is on the front iff it is more accurate than every faster point.
        if p.accuracy > best_acc:
            front.append(p)
            best_acc = p.accuracy
    return front


def _speed_phrase(p: Point, base: Point | None, baseline: str) -> tuple[float | None, str]:
    if base is None:
        return None, f"no {baseline} baseline measured on {p.runtime}"
    speedup = base.latency_s / p.latency_s
    if p.scheme == base.scheme:
        return 1.0, f"the {baseline} baseline"
    if speedup >= 1.0:
        return speedup, f"{_fmt_ratio(speedup)} faster than {baseline}"
    return speedup, f"{_fmt_ratio(1.0 / speedup)} slower than {baseline}"


def recommend(
    points: Sequence[Point],
    target_db: float = DEFAULT_TARGET_DB,
    baseline: str = "fp32",
) -> Recommendation:
    """The fastest scheme whose SQNR meets `target_db` among points of ONE (variant, runtime, tokens).

    The float baseline (SQNR None = exact) always meets the target, so when no quantized scheme
    both meets the target and beats it beyond the measured spread (`beats`: its p90 below the
    baseline's p10), the recommendation is to stay at the baseline; the reason then names the
    fastest quantized scheme and why it was not chosen. Without any point meeting the target
    (no baseline measured), the most accurate point is named instead.
    """
    if not math.isfinite(target_db):
        raise FFNQuantError(f"accuracy target must be a finite number of dB, got {target_db!r}")
    if not points:
        raise FFNQuantError("recommend() needs at least one measured point")
    keys = {(p.variant, p.runtime, p.tokens) for p in points}
    if len(keys) != 1:
        raise FFNQuantError(f"recommend() takes the points of one (variant, runtime, tokens), got {sorted(keys)}")
    variant, runtime, tokens = next(iter(keys))
    where = f"on {runtime} at M={tokens}"
    base = next((p for p in points if p.scheme == baseline), None)
    suspect = [p for p in points if p.suspect]
    if suspect:
        # a timing not to be trusted decides nothing: with the baseline's suspect no scheme is called faster,
        # else the suspect points are left out and named in the reason
        why = "; ".join(f"{p.label}: {p.suspect}" for p in suspect)
        trusted = [p for p in points if not p.suspect]
        if base is not None and base.suspect:
            return Recommendation(variant, runtime, tokens, target_db, base.scheme, f"{base.label} (timing suspect)",
                                  None, None, baseline, None, True,
                                  f"{base.label}: the timings {where} are suspect ({why}), so no scheme is called "
                                  "faster than the baseline; measure again on a quieter machine")
        if not trusted:
            return Recommendation(variant, runtime, tokens, target_db, None, None, None, None, baseline, None, False,
                                  f"no timing {where} can be trusted ({why})")
        rec = recommend(trusted, target_db, baseline)
        return replace(rec, reason=f"{rec.reason} (not used, timing suspect: {why})")
    ok = [p for p in points if p.accuracy >= target_db]
    # Fastest first; on equal latency the more accurate one.
    ok.sort(key=lambda p: (p.latency_s, -p.accuracy, p.scheme))

    if not ok:
        best = max(points, key=lambda p: (p.accuracy, -p.latency_s))
        speedup, phrase = _speed_phrase(best, base, baseline)
        reason = (
            f"nothing meets the {target_db:g} dB target {where}; the most accurate is "
            f"{best.label} at {_fmt_db(best)} ({phrase})"
        )
        return Recommendation(variant, runtime, tokens, target_db, best.scheme, best.label, best.sqnr_db,
                              best.latency_s, baseline, speedup, False, reason)

    if base is not None:
        winners = [p for p in ok if p.scheme != base.scheme and beats(p, base)]
        pick = winners[0] if winners else base
    else:
        pick = ok[0]
    speedup, phrase = _speed_phrase(pick, base, baseline)
    if base is not None and pick.scheme == base.scheme:
        quantized = sorted((p for p in points if p.scheme != base.scheme), key=lambda p: (p.latency_s, -p.accuracy))
        if quantized:
            q = quantized[0]
            if q.accuracy >= target_db:
                why = f"{q.label} meets it ({_fmt_db(q)}) but {_not_faster(q, base, baseline)}"
            else:
                why = f"the fastest quantized scheme, {q.label}, reaches only {_fmt_db(q)}"
                faster_ok = [p for p in ok if p.scheme != base.scheme]
                if faster_ok:
                    f = faster_ok[0]
                    why += f", and {f.label} ({_fmt_db(f)}) {_not_faster(f, base, baseline)}"
            reason = f"{base.label}: no quantized scheme meeting {target_db:g} dB is faster {where} ({why})"
        else:
            reason = f"{base.label}: only the baseline was measured {where}"
        return Recommendation(variant, runtime, tokens, target_db, base.scheme, base.label, None, base.latency_s,
                              baseline, 1.0, True, reason)

    reason = f"{pick.label}: {_fmt_db(pick)} >= {target_db:g} dB target, {phrase} {where}"
    return Recommendation(variant, runtime, tokens, target_db, pick.scheme, pick.label, pick.sqnr_db, pick.latency_s,
                          baseline, speedup, True, reason)


def _not_faster(p: Point, base: Point, baseline: str) -> str:
    """Why `p` does not beat `base`: slower, or faster only within the measured spread."""
    if p.latency_s >= base.latency_s:
        return f"is {_fmt_ratio(p.latency_s / base.latency_s)} slower"
    return (f"is {_fmt_ratio(base.latency_s / p.latency_s)} faster only within the measured spread "
            f"(its p90 {_fmt_s(p.slow_end)} is not below the {baseline} p10 {_fmt_s(base.fast_end)})")


def recommend_all(
    points: Iterable[Point],
    target_db: float = DEFAULT_TARGET_DB,
    baseline: str = "fp32",
) -> list[Recommendation]:
    """`recommend` for every (variant, runtime, tokens) present, in a stable order."""
    groups: dict[tuple[str, str, int], list[Point]] = {}
    for p in points:
        groups.setdefault((p.variant, p.runtime, p.tokens), []).append(p)
    return [recommend(groups[k], target_db, baseline) for k in sorted(groups)]


def crest_cost_finding(
    crest: Mapping[str, float],
    sqnr_db: Mapping[str, float],
    scheme: str = "w8a8",
    site: str = "hidden",
    wide: str = "swiglu",
    narrow: str = "relu",
) -> dict[str, Any] | None:
    """How much wider one variant's `site` range is than another's (crest factor absmax/std), and
    what that costs at `scheme` in dB, with a least-squares slope across all variants given.

    `crest` and `sqnr_db` are keyed by variant. When `wide`/`narrow` are not both measured, the
    widest and narrowest measured variants (by crest factor) are compared instead. Returns None
    when fewer than two variants have both figures.
    """
    common = sorted(v for v in crest if v in sqnr_db and crest[v] and math.isfinite(crest[v]) and math.isfinite(sqnr_db[v]))
    if len(common) < 2:
        return None
    if wide not in common or narrow not in common or wide == narrow:
        wide = max(common, key=lambda v: crest[v])
        narrow = min(common, key=lambda v: crest[v])
    ratio = crest[wide] / crest[narrow]
    cost = sqnr_db[narrow] - sqnr_db[wide]
    text = (
        f"{wide}'s `{site}` has a crest factor (absmax/std) of {crest[wide]:.1f} against {narrow}'s "
        f"{crest[narrow]:.1f} ({ratio:.1f}x wider); at {scheme} {wide} reaches {sqnr_db[wide]:.1f} dB and "
        f"{narrow} {sqnr_db[narrow]:.1f} dB, "
        + (f"so the wider range costs {cost:.1f} dB" if cost >= 0 else f"so {wide} is {-cost:.1f} dB more accurate despite the wider range")
    )
    out: dict[str, Any] = {
        "scheme": scheme,
        "site": site,
        "wide": wide,
        "narrow": narrow,
        "crest_wide": crest[wide],
        "crest_narrow": crest[narrow],
        "crest_ratio": ratio,
        "sqnr_wide_db": sqnr_db[wide],
        "sqnr_narrow_db": sqnr_db[narrow],
        "cost_db": cost,
        "slope_db_per_doubling": None,
        "n_variants": len(common),
        "text": text,
    }
    xs = [math.log2(crest[v]) for v in common]
    ys = [sqnr_db[v] for v in common]
    if len(common) >= 3 and max(xs) - min(xs) > 1e-9:
        # Ordinary least squares of SQNR on log2(crest): dB lost per doubling of the range.
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        out["slope_db_per_doubling"] = slope
        out["text"] += (
            f"; across {len(common)} variants {scheme} SQNR changes by {slope:+.1f} dB per doubling of the "
            f"`{site}` crest factor (least squares)"
        )
    return out
