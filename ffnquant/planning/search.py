"""The plan search: one candidate per layer, cheapest total cost with the predicted damages within a budget.

This is the multiple-choice knapsack problem. It is solved exactly by dynamic programming over the damage
budget cut into `resolution` steps (each damage rounded up, so a solution is never predicted better than it
is): layers x candidates x steps operations, milliseconds for a 30-layer model. A greedy walk by marginal
benefit per cost is optimal only when each layer's (damage, cost) front is convex, and measured fronts are
not (an int4 recipe can be both cheaper and more accurate than an int8 one with a bad calibrator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import FFNQuantError

__all__ = ["Option", "solve", "pareto", "tie", "tied_groups"]


@dataclass(frozen=True)
class Option:
    """One candidate of one layer: its name, predicted damage (>= 0, budget units) and cost (the objective)."""

    name: str
    damage: float
    cost: float


def pareto(options: Sequence[Option]) -> list[Option]:
    """The options no other option beats on both damage and cost (ties keep the first), sorted by cost."""
    front: list[Option] = []
    for o in sorted(options, key=lambda o: (o.cost, o.damage)):
        if not front or o.damage < front[-1].damage:
            front.append(o)
    return front


def tie(layers: Mapping[int, Sequence[Option]], tied: Sequence[int]) -> dict[int, list[Option]]:
    """`layers` with the layers of `tied` made one, under the first of them: one option per name every tied layer
    has, its damage and cost summed over them (each damage counted from zero, as `solve` counts it). A format that
    stores one scheme for all of them (a folder's routed experts, `deploy.ctensors`) is planned so."""
    tied = sorted(set(tied) & set(layers))
    if len(tied) < 2:
        return {i: list(opts) for i, opts in layers.items()}
    names = [o.name for o in layers[tied[0]] if all(any(p.name == o.name for p in layers[i]) for i in tied[1:])]
    if not names:
        raise FFNQuantError(f"layers {', '.join(map(str, tied))} must take one candidate and have none in common")
    by = {i: {o.name: o for o in layers[i]} for i in tied}
    joint = [Option(n, sum(max(0.0, by[i][n].damage) for i in tied), sum(by[i][n].cost for i in tied)) for n in names]
    return {i: opts for i, opts in ((i, list(o)) for i, o in layers.items() if i not in tied[1:])} | {tied[0]: joint}


def tied_groups(tied: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """`tied` as disjoint groups of layers: one group of ints, or several (a folder's routed experts, each FFN that
    several layers call), overlapping ones merged."""
    groups = [set(tied)] if all(isinstance(i, int) for i in tied) else [set(g) for g in tied]
    merged: list[set[int]] = []
    for g in groups:
        for m in [m for m in merged if m & g]:
            g |= m
            merged.remove(m)
        merged.append(g)
    return sorted((sorted(g) for g in merged if len(g) > 1), key=lambda g: g[0])


def solve(layers: Mapping[int, Sequence[Option]], budget: float, resolution: int = 2000,
          tied: Sequence[int] | Sequence[Sequence[int]] = ()) -> dict[int, Option] | None:
    """The choice per layer minimising the summed cost with summed damage <= `budget`; None when even the least
    damaging choice per layer exceeds it. Damages below zero count as zero (a measurement cannot promise gain).
    The layers of each group of `tied` (a group, or several) take one candidate, the same name in each (`tie`)."""
    groups = [g for g in ([i for i in g if i in layers] for g in tied_groups(tied)) if len(g) > 1]
    if groups:
        joint: dict[int, list[Option]] = {i: list(o) for i, o in layers.items()}
        for g in groups:
            joint = tie(joint, g)
        chosen = solve(joint, budget, resolution)
        if chosen is None:
            return None
        lead = {i: g[0] for g in groups for i in g}
        return {i: (next(o for o in layers[i] if o.name == chosen[lead[i]].name) if i in lead else chosen[i])
                for i in sorted(layers)}
    if budget < 0 or not math.isfinite(budget):
        raise FFNQuantError(f"search budget must be a finite number >= 0, got {budget!r}")
    if any(not opts for opts in layers.values()):
        raise FFNQuantError("every layer needs at least one candidate")
    order = sorted(layers)
    fronts = {i: pareto([Option(o.name, max(0.0, o.damage), o.cost) for o in layers[i]]) for i in order}
    if sum(min(o.damage for o in fronts[i]) for i in order) > budget:
        return None
    step = budget / resolution if budget > 0 else 1.0

    def units(o: Option) -> int:
        if o.damage <= 0:
            return 0
        if budget == 0:  # no damage allowed: beyond every step of the table
            return resolution + 1
        return math.ceil(o.damage / step - 1e-9)

    inf = float("inf")
    # tables[j][b]: least cost of layers order[:j] with damage of exactly b steps (inf: unreachable)
    tables = [np.full(resolution + 1, inf)]
    tables[0][0] = 0.0
    for i in order:
        prev, new = tables[-1], np.full(resolution + 1, inf)
        for o in fronts[i]:
            u = units(o)
            if u <= resolution:
                new[u:] = np.minimum(new[u:], prev[: resolution + 1 - u] + o.cost)
        tables.append(new)
    b = int(np.argmin(tables[-1]))
    if not math.isfinite(tables[-1][b]):
        return None  # damages rounded up to whole steps can overrun a budget the raw sums fit: infeasible
    out: dict[int, Option] = {}
    for j in range(len(order), 0, -1):  # walk back: which option reaches tables[j][b] from tables[j - 1]
        i = order[j - 1]
        for o in fronts[i]:
            u = units(o)
            if u <= b and np.isclose(tables[j - 1][b - u] + o.cost, tables[j][b], rtol=0, atol=1e-9):
                out[i], b = o, b - u
                break
    return {i: next(orig for orig in layers[i] if orig.name == out[i].name) for i in order}
