"""onnxruntime's floor under a plan: a static int8 candidate below onnxruntime's best own quantizer on its layer
(quantize_static MinMax / Percentile, quantize_dynamic: `FLOOR_METHODS`) is left out, and the floor is measured on
a layer only once a solution picks a static int8 candidate there; the deferred candidates are scored the same way, only on
the layers where a solution picks one (`FloorSearch`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ..infra.atomic import ScratchFolder
from ..numerics.accuracy import run_batched
from ..onnx.export import onnx_proto
from ..onnx.ortbaseline import ort_baselines
from ..recipe import Recipe
from .candidates import deferred
from .search import Option, solve

__all__ = ["BOUND_MARGIN", "FLOOR_CLEARANCE_DB", "FLOOR_METHODS", "SAMPLE_LAYERS", "floor_args", "ort_best", "ort_exclude", "ort_floor",
           "rtn_counterpart", "static_int8", "FloorSearch"]

# onnxruntime's quantizers the floor runs. Not Entropy: at quantize_static's defaults it histograms all calibration
# outputs at once, so its one candidate threshold is the whole range and it writes MinMax's model (the same
# initializers, `tests/test_ortbaseline.py`), at the cost of a histogram calibration per layer.
FLOOR_METHODS = ("minmax", "percentile", "dynamic")

# A static int8 candidate this far above the best plain static int8 of its layer (ffnquant's own int8 weights and
# activations, no transform: `w8a8@minmax`, `w8a8@search`) is not below onnxruntime's best there, whose quantizers
# compute the same int8 grid with no transform: over the 103 layers of SmolLM2-135M and Gemma 3 270M where the floor was
# measured, onnxruntime's best was 3.1 dB below to 2.1 dB above that plain int8. The floor is not measured for it
# (`FloorSearch`; the layer says so): the candidates a plan picks keep a float site or rotate, mostly 10-25 dB above.
FLOOR_CLEARANCE_DB = 6.0

# A deferred candidate's damage bound on a layer where it is not scored, learned on the model (`FloorSearch`): this
# share of the least ratio of its scored damage to its round-to-nearest counterpart's (`rtn_counterpart`) seen so
# far, times the counterpart's damage there (never more than on the median layer). Measured on two trained models
# (SmolLM2-135M, Gemma 3 270M; 48 layers): GPTQ's and AWQ's damage was 0.16-1.7x and 0.09-0.86x round to nearest's,
# the lowest ratios on the layers where round to nearest fails (its damage 10-20x the median layer's).
BOUND_MARGIN = 0.5
# the layers a deferred candidate is scored on, where a solution picks it, before its bound is learned
SAMPLE_LAYERS = 2


def ort_best(layer: Any, calib: torch.Tensor, held: torch.Tensor, settings: Any) -> dict[str, Any] | None:
    """onnxruntime's best own quantizer of this layer (quantize_static MinMax / Percentile and quantize_dynamic,
    `FLOOR_METHODS`, on the same calibration and held-out inputs): {method, sqnr_db, methods}, or None."""
    return ort_floor(*floor_args(layer, calib, held, settings))


def floor_args(layer: Any, calib: torch.Tensor, held: torch.Tensor, settings: Any) -> tuple:
    """`ort_floor`'s arguments for a layer: what a helper process needs of it. The FFN's fp32 ONNX graph (as bytes,
    `onnx.export.onnx_proto`) and its float outputs on the held-out rows are made here, where the exporter is warm
    (its graph template is cached per FFN structure): a helper would otherwise import torch's ONNX exporter and
    trace the FFN itself (about 5 s) before its first layer."""
    graph = onnx_proto(layer.ffn)[0].SerializeToString()
    with torch.no_grad():
        ref = run_batched(layer.ffn, held)
    return layer.label, graph, calib, held, ref, settings.seq_len * settings.batch_size, FLOOR_METHODS


def ort_floor(label: str, graph: bytes, calib: torch.Tensor, held: torch.Tensor, ref: torch.Tensor, run_tokens: int,
              methods: Sequence[str] = FLOOR_METHODS) -> dict[str, Any] | None:
    """`ort_best` of one FFN, given as its fp32 ONNX graph's bytes and its float outputs `ref` on `held` (`label`
    names its files): a module-level function of plain data, so a helper process can run it
    (`infra.sidecar.side_by_side`)."""
    with ScratchFolder("plan-ort") as folder:  # marked: a killed run's is swept by the next run
        fp32 = Path(folder) / f"{label}.fp32.onnx"
        fp32.write_bytes(graph)
        res = ort_baselines(fp32, [calib[i : i + 1024] for i in range(0, calib.shape[0], 1024)], held, ref,
                            run_tokens=run_tokens, methods=tuple(methods))
    best = res.get("best")
    if not best:
        return None
    return {"method": best["method"], "sqnr_db": best["sqnr_db"],
            "methods": {m: v.get("sqnr_db") for m, v in res["methods"].items()}}


def ort_exclude(best: dict[str, Any] | None, recipes: Sequence[Recipe], rows: list[dict[str, Any]]) -> None:
    """Every static int8 candidate whose held-out layer SQNR falls below onnxruntime's best own quantizer on the
    layer is excluded: a user would do better with onnxruntime's quantizer alone."""
    if best is None:
        return
    for recipe, row in zip(recipes, rows):
        if row.get("error") is not None or "excluded" in row:
            continue
        if static_int8(recipe) and row["layer_sqnr_db"] < best["sqnr_db"]:
            row["excluded"] = (f"below onnxruntime's best own quantizer on this layer ({row['layer_sqnr_db']:.1f} dB < "
                               f"{best['sqnr_db']:.1f} dB, {best['method']})")


def rtn_counterpart(recipe: Recipe, rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The scored row of `rows` (one layer's candidates) that rounds `recipe`'s weights to nearest: weight-only, the
    same weight dtype, no transform, no second-order calibration (the plan's 4-bit probe, `job.PROBES`); None where
    none was scored (a probe the latency table says can never be chosen is quantized for its ablation, not scored:
    `"scored": False`)."""
    want = recipe.resolve()
    for row in rows:
        if not _scored(row) or row["recipe"] == str(recipe):
            continue
        other = Recipe.parse(row["recipe"])
        scheme = other.resolve()
        if (not other.is_float and not other.transforms and not scheme.needs_hessians and not scheme.static_activations
                and scheme.act_dtype == want.act_dtype and scheme.weight_dtype == want.weight_dtype):
            return row
    return None


def _scored(row: dict[str, Any]) -> bool:
    """Whether a candidate row holds scores (not deferred, not left out unscored, not failed)."""
    return not row.get("deferred") and row.get("scored") is not False and row.get("error") is None


def static_int8(recipe: Recipe) -> bool:
    """Whether `recipe` quantizes activations to integers with static (calibrated) ranges."""
    scheme = recipe.resolve()
    return scheme.static_activations and scheme.act_dtype.is_integer


class FloorSearch:
    """`search.solve` with what costs seconds per layer measured only on the layers where it can matter.

    - onnxruntime's floor: a static int8 candidate below onnxruntime's best own quantizer on its layer is left out
      (`ort_exclude`); the floor is measured on a layer once a solution picks a static int8 candidate there, unless
      that candidate clears the layer's plain static int8 by `FLOOR_CLEARANCE_DB` (`cleared`: the layer's
      `ort_cleared` says by how much).
    - Deferred candidates (`candidates.deferred`: GPTQ's and AWQ's calibration from second-order statistics) enter
      the search unscored, at their known cost and a damage of zero; once a solution picks one on a layer, that
      layer's deferred candidates are scored (`score`).
    After either, the layer's options are made again from its rows (`options_of`) and the search solved again.

    The result is the one the eager measurement gives: the search as it stands is a relaxation of the eager one
    (fewer exclusions, and damages no larger than the true ones, at the same costs), so its optimum is at least as
    cheap; once that optimum picks no unmeasured static int8 candidate and no unscored one, every option it holds
    carries its true values, so it is feasible, hence optimal, in the eager search too.

    With `least_gain` (a share of the cost, > 0), the deferred candidates are scored only when they could save
    more: when the optimum with them unscored (a lower bound of what scoring them can give) costs at least
    (1 - least_gain) of the optimum without them, the latter is taken and none is scored (`deferred_skipped` says
    why). A latency table cannot tell two plans that close apart (`steering.min_gain`), so the result is then the
    eager one's up to a saving it cannot resolve.

    With `damage` (a row's damage, as `options_of` reads it), a deferred candidate's zero is replaced by a bound
    learned on the model: picked on layers where it has none yet, it is scored on `SAMPLE_LAYERS` of them first (the
    most typical by its round-to-nearest counterpart's damage), and from then on enters the search unscored at
    `BOUND_MARGIN` x the least ratio of its scored damage to that counterpart's seen so far, times the counterpart's
    damage on the layer (at most the median layer's), written as the row's `damage_bound`. At no damage a 4-bit
    candidate undercuts the float FFN on every layer, so a solution picks it everywhere and every layer is scored
    for one that chooses it nowhere (measured on Gemma 3 270M: 37 s of a 201 s plan); with the bound only the layers
    where it can win are. The result is the eager one's wherever no layer's ratio falls below the bound
    (`bounds` says what was learned)."""

    def __init__(self, per_layer: dict[int, dict[str, Any]], recipes: Sequence[Recipe],
                 options_of: Callable[[int], list[Option]], measure: Callable[[int], dict[str, Any] | None],
                 score: Callable[[int], None] | None = None,
                 measure_many: Callable[[list[int]], Iterable[tuple[int, dict[str, Any] | None]]] | None = None,
                 least_gain: float = 0.0, tied: Sequence[int] | Sequence[Sequence[int]] = (),
                 damage: Callable[[dict[str, Any]], float] | None = None) -> None:
        """`measure(i)`: layer i's floor; `measure_many(layers)`, when given, yields (i, floor) for all the layers one
        solution needs at once (side by side with a helper process, `infra.sidecar`). `deferred_skipped`: why no
        deferred candidate was scored, while none has been. `tied`: layers that take one candidate (a group, or
        several: `search.tied_groups`).
        `damage`: a row's damage, for the deferred candidates' learned bounds (None: they enter at zero)."""
        self.per_layer, self.recipes, self.options_of, self.measure, self.score = (per_layer, recipes, options_of,
                                                                                  measure, score)
        self.measure_many = measure_many
        self.least_gain = least_gain
        self.tied = tuple(tied)
        self.deferred_skipped: str | None = None
        self._scored_any = False
        self.options = {i: options_of(i) for i in per_layer}
        self.static = {str(r) for r in recipes if static_int8(r)}
        self.damage = damage
        self._recipes = {str(r): r for r in recipes}
        # per deferred candidate, its scored damage over its round-to-nearest counterpart's, on each layer scored
        self.ratios: dict[str, list[float]] = {}
        self._median: dict[str, float | None] = {}
        self._base: dict[tuple[int, str], float | None] = {}  # `_counterpart`'s, once per layer and candidate

    def _unscored(self, i: int) -> set[str]:
        return {r["recipe"] for r in self.per_layer[i]["candidates"] if r.get("deferred")}

    def cleared(self, i: int, name: str) -> str | None:
        """Why the floor need not be measured for static int8 candidate `name` on layer i (it clears the layer's best
        plain static int8 by `FLOOR_CLEARANCE_DB`), or None."""
        rows = self.per_layer[i]["candidates"]
        plain = [(r["layer_sqnr_db"], r["recipe"]) for r in rows
                 if r["recipe"] in self.static and r.get("error") is None and r.get("layer_sqnr_db") is not None
                 and not self._recipes[r["recipe"]].transforms]
        mine = next((r.get("layer_sqnr_db") for r in rows if r["recipe"] == name and r.get("error") is None), None)
        if not plain or mine is None or name == max(plain)[1]:
            return None
        db, best = max(plain)
        if mine < db + FLOOR_CLEARANCE_DB:
            return None
        return (f"{name} at {mine:.1f} dB clears the layer's plain static int8 ({best}, {db:.1f} dB) by "
                f"{mine - db:.1f} dB (>= {FLOOR_CLEARANCE_DB:g} dB): not measured")

    def _counterpart(self, i: int, name: str) -> float | None:
        """The damage of `name`'s round-to-nearest counterpart on layer i (a scored row: it does not change), or None."""
        if (i, name) not in self._base:
            row = rtn_counterpart(self._recipes[name], self.per_layer[i]["candidates"])
            value = None if row is None or self.damage is None else self.damage(row)
            self._base[i, name] = value if value is not None and math.isfinite(value) and value > 0 else None
        return self._base[i, name]

    def _typical(self, layers: list[int], name: str) -> list[int]:
        """`layers` ordered by how close their counterpart's damage is to the median layer's (unknown ones last)."""
        median = self._median_of(name)

        def distance(i: int) -> float:
            base = self._counterpart(i, name)
            return abs(math.log(base / median)) if median and base else math.inf

        return sorted(layers, key=distance)

    def _median_of(self, name: str) -> float | None:
        if name not in self._median:
            known = [v for v in (self._counterpart(i, name) for i in self.per_layer) if v is not None]
            self._median[name] = float(np.median(known)) if known else None
        return self._median[name]

    def _learn(self, layers: Sequence[int]) -> None:
        """The ratios of the deferred candidates just scored on `layers`, and every unscored one's bound from them."""
        for i in layers:
            for row in self.per_layer[i]["candidates"]:
                name = row["recipe"]
                if name not in self._recipes or not _scored(row) or not deferred(self._recipes[name]):
                    continue
                base, value = self._counterpart(i, name), self.damage(row)
                if base is not None and value is not None and math.isfinite(value):
                    self.ratios.setdefault(name, []).append(value / base)
        for i, entry in self.per_layer.items():
            changed = False
            for row in entry["candidates"]:
                name = row["recipe"]
                if not row.get("deferred") or name not in self.ratios:
                    continue
                base, median = self._counterpart(i, name), self._median_of(name)
                if base is None or median is None:
                    continue
                row["damage_bound"] = BOUND_MARGIN * min(self.ratios[name]) * min(base, median)
                changed = True
            if changed:
                self.options[i] = self.options_of(i)

    @property
    def bounds(self) -> dict[str, dict[str, Any]]:
        """What the deferred candidates' bounds were learned from: {recipe: {least_ratio, share, layers}}."""
        return {name: {"least_ratio": min(r), "share": BOUND_MARGIN * min(r), "layers": len(r)}
                for name, r in self.ratios.items()}

    def _sampled(self, chosen: dict[int, Option], unscored: list[int]) -> list[int]:
        """The layers of `unscored` to score now: all whose pick has a learned bound, and `SAMPLE_LAYERS` of those
        whose pick has none (the most typical), so that a bound is learned before the other layers are scored."""
        if self.damage is None:
            return unscored
        # a pick with no counterpart scored on any layer learns no bound: scored wherever picked, as without `damage`
        fresh = [i for i in unscored if chosen[i].name not in self.ratios and self._median_of(chosen[i].name)]
        known = [i for i in unscored if i not in fresh]
        by_pick: dict[str, list[int]] = {}
        for i in fresh:
            by_pick.setdefault(chosen[i].name, []).append(i)
        sample = {i for name, layers in by_pick.items() for i in self._typical(layers, name)[:SAMPLE_LAYERS]}
        return [i for i in unscored if i in known or i in sample]

    def _worth_scoring(self, chosen: dict[int, Option], budget: float) -> dict[int, Option]:
        """`chosen` (an optimum picking unscored candidates), or the optimum without any unscored candidate when
        `chosen`'s cost, a bound no scoring can beat, saves less than `least_gain` of that one's."""
        if self.least_gain <= 0:
            return chosen
        unscored = {i: self._unscored(i) for i in self.options}
        without = solve({i: [o for o in opts if o.name not in unscored[i]] for i, opts in self.options.items()}, budget,
                        tied=self.tied)
        if without is None:
            return chosen
        bound, cost = sum(o.cost for o in chosen.values()), sum(o.cost for o in without.values())
        if cost <= 0 or bound < (1.0 - self.least_gain) * cost:
            return chosen
        if not self._scored_any:
            self.deferred_skipped = (f"not scored: even at no damage they could save {1.0 - bound / cost:.1%} of "
                                     f"the plan's cost, within the cost table's resolution of {self.least_gain:.1%}")
        return without

    def solve(self, budget: float) -> dict[int, Option] | None:
        while True:
            chosen = solve(self.options, budget, tied=self.tied)
            if chosen is None:
                return None
            unscored = [i for i, o in chosen.items() if o.name in self._unscored(i)]
            if unscored:
                chosen = self._worth_scoring(chosen, budget)
                unscored = [i for i, o in chosen.items() if o.name in self._unscored(i)]
            clear = {i: self.cleared(i, o.name) for i, o in chosen.items()
                     if o.name in self.static and self.per_layer[i].get("ort_floor") == "pending"}
            floors = [i for i, why in clear.items() if why is None]
            if not floors and not unscored:
                for i, entry in self.per_layer.items():  # what the solution stands on where the floor was not measured
                    if clear.get(i):
                        entry["ort_cleared"] = clear[i]
                    else:
                        entry.pop("ort_cleared", None)
                return chosen
            if unscored and self.score is None:
                raise ValueError("FloorSearch: deferred candidates without a `score` to score them")
            if unscored:
                self.deferred_skipped = None  # some are scored: "none was" no longer holds
                self._scored_any = True
            unscored = self._sampled(chosen, unscored)
            for i in unscored:
                self.score(i)  # the layer's deferred rows replaced by scored ones
            measured = self.measure_many(floors) if self.measure_many else ((i, self.measure(i)) for i in floors)
            for i, best in measured:
                entry = self.per_layer[i]
                entry["ort_best"] = best
                entry["ort_floor"] = "measured"
                ort_exclude(best, self.recipes, entry["candidates"])
            for i in dict.fromkeys(unscored + floors):
                self.options[i] = self.options_of(i)
            if unscored and self.damage is not None:
                self._learn(unscored)
