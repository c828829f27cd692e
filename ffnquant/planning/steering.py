"""How the verification rounds of `planning.job.make_plan` choose their damage budgets.

A round quantizes every layer as the search chose within a damage budget and measures the whole model on the
held-out text; it meets the target when the unfavourable end of each domain's 95% interval does. Both the
measured figure and the interval's half-width grow with the plan's predicted damage D: the point about in
proportion (a x D: the additive prediction is first order), the half-width about as sqrt(D) (the per-token spread
of the log-likelihood ratio is about sqrt(KL)). `noise_model` fits a and c per domain on the rounds so far,
`next_budget` picks the largest D whose bound stays within `AIM` of the target, bracketed by the rounds that met
and missed; before the first round c comes from the probes' ablations (`first_noise`). Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .target import Target

__all__ = ["AIM", "MIN_GAIN", "UP_STEP", "RoundPoint", "noise_model", "first_noise", "next_budget", "min_gain"]

# A round aims its predicted damage at this share of the budget: the noise model below is fitted on a few rounds.
AIM = 0.95
# Another round is run only when its plan would cost this share less than the cheapest round that met, or more when
# the cost table cannot resolve that (`min_gain`).
MIN_GAIN = 0.01
# A round's damage is at most this many times the largest damage a round so far measured (when that one met): the
# noise model is fitted on the rounds so far, and beyond them the measured damage and its interval grow faster than
# it says (other recipes enter the plan, whose prediction is less exact). Measured on Gemma 3 270M: from a round that
# met at predicted 0.0059 nats, the model asked for 0.0123 (2.1x); the point measured 1.4x and the interval 2.4x what
# it predicted, and that round and the next missed.
UP_STEP = 1.5


def min_gain(latency: Mapping[str, Mapping[str, Any]] | None) -> float:
    """The least saving worth another verification round: MIN_GAIN, or a measured latency table's resolution when
    coarser: twice the median over its timed recipes of the relative standard error of each one's median request
    time (`latency_table.request_row`). A plan that a table times within two of its standard errors of the one that
    met is not known to be cheaper (at about 95%), and a round costs a whole pass of the held-out text. Bytes (no
    table) are exact."""
    errors = sorted(float(row["median_rel_se"]) for row in (latency or {}).values()
                    if row.get("median_rel_se") is not None and not row.get("timed_as"))
    return max(MIN_GAIN, 2.0 * errors[len(errors) // 2]) if errors else MIN_GAIN


@dataclass(frozen=True)
class RoundPoint:
    """What steers the next verification round: a round's predicted damage (the sum over its chosen layers), whether
    it met the target, and per held-out domain its measured (point, unfavourable bound) in budget units."""

    predicted: float
    met: bool
    domains: Mapping[str, tuple[float, float]]


def noise_model(points: Sequence[RoundPoint], prior: Mapping[str, float] | None = None) -> dict[str, tuple[float, float]]:
    """Per domain (a, c) of: measured point = a x D, bound - point = c x sqrt(D), D a round's predicted damage,
    least squares through the origin over the rounds so far. The point grows with the damage; the interval's
    half-width grows as its square root (the per-token spread of the log-likelihood ratio is about sqrt(KL)). With
    no round yet: a = 1 and c from `prior` (`first_noise`). a is kept >= 0.1: a round measured at or below zero
    says its damage is small, not that more damage is free."""
    if not points:
        return {label: (1.0, c) for label, c in (prior or {}).items()}
    out = {}
    for label in points[-1].domains:
        rows = [(pt.predicted, *pt.domains[label]) for pt in points if label in pt.domains and pt.predicted > 0]
        den = sum(d * d for d, _, _ in rows)
        a = sum(p * d for d, p, _ in rows) / den if den > 0 else 1.0
        den_c = sum(d for d, _, _ in rows)
        c = sum(max(0.0, b - p) * math.sqrt(d) for d, p, b in rows) / den_c if den_c > 0 else 0.0
        out[label] = (max(0.1, a), max(0.0, c))
    return out


def _largest_damage(a: float, c: float, goal: float) -> float:
    """The largest D with a x D + c x sqrt(D) <= goal."""
    s = (-c + math.sqrt(c * c + 4.0 * a * goal)) / (2.0 * a)
    return s * s


def first_noise(target: Target, w: float | None, tokens: Mapping[str, int]) -> dict[str, float]:
    """The first round's c per held-out domain (`noise_model`): for a ppl target, the half-width of the interval
    of the mean log-likelihood ratio over N tokens at KL D is about 2 sqrt(w D / N), w measured on the probes'
    ablations (`sensitivity.noise_per_kl`; 2, independent tokens, without one). The other targets start at c = 0
    and learn theirs from the first round."""
    if target.metric != "ppl":
        return {label: 0.0 for label in tokens}
    w = 2.0 if w is None else max(w, 2.0)
    return {label: 2.0 * math.sqrt(w / max(1, n)) for label, n in tokens.items()}


def next_budget(points: Sequence[RoundPoint], budget: float, prior: Mapping[str, float] | None = None,
                aim: float = AIM) -> float | None:
    """The next round's damage budget, or None when the plan is settled.

    The largest predicted damage whose measured bound, by `noise_model` fitted on every round so far (or `prior`
    before the first), stays within `aim` x the target's budget on every held-out domain; kept strictly between the
    largest damage that met (above it) and the smallest that missed (below it), and, while none missed, at most
    `UP_STEP` x the largest damage that met. None when that is no more than 5% above a damage that already met:
    the rounds have found the plan."""
    model = noise_model(points, prior)
    want = min((_largest_damage(a, c, aim * budget) for a, c in model.values()), default=aim * budget)
    if not points:
        return want
    met = max((pt.predicted for pt in points if pt.met), default=None)
    missed = min((pt.predicted for pt in points if not pt.met), default=None)
    if missed is not None and want >= 0.95 * missed:
        want = math.sqrt(met * missed) if met is not None else 0.7 * missed
    if met is not None and want <= 1.05 * met:
        return None
    last = points[-1].predicted
    if met and missed is None:  # no further than the rounds have measured (`UP_STEP`; a float plan, 0, says nothing)
        want = min(want, UP_STEP * met)
    return min(max(want, last / 4.0), 3.0 * last) if last > 0 else want
