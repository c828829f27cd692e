"""onnxruntime's floor under a plan: a static int8 candidate below onnxruntime's best own quantizer on its layer
(quantize_static MinMax / Percentile, quantize_dynamic: `FLOOR_METHODS`) is left out, and the floor is measured on
a layer only once a solution picks a static int8 candidate there; the deferred candidates are scored the same way, only on
the layers where a solution picks one (`FloorSearch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from ..infra.atomic import ScratchFolder
from ..numerics.accuracy import run_batched
from ..onnx.export import onnx_proto
from ..onnx.ortbaseline import ort_baselines
from ..recipe import Recipe
from .search import Option, solve

__all__ = ["FLOOR_METHODS", "floor_args", "ort_best", "ort_exclude", "ort_floor", "static_int8", "FloorSearch"]

# onnxruntime's quantizers the floor runs. Not Entropy: at quantize_static's defaults it histograms all calibration
# outputs at once, so its one candidate threshold is the whole range and it writes MinMax's model (the same
# initializers, `tests/test_ortbaseline.py`), at the cost of a histogram calibration per layer.
FLOOR_METHODS = ("minmax", "percentile", "dynamic")


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


def static_int8(recipe: Recipe) -> bool:
    """Whether `recipe` quantizes activations to integers with static (calibrated) ranges."""
    scheme = recipe.resolve()
    return scheme.static_activations and scheme.act_dtype.is_integer


class FloorSearch:
    """`search.solve` with what costs seconds per layer measured only on the layers where it can matter.

    - onnxruntime's floor: a static int8 candidate below onnxruntime's best own quantizer on its layer is left out
      (`ort_exclude`); the floor is measured on a layer once a solution picks a static int8 candidate there.
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
    eager one's up to a saving it cannot resolve."""

    def __init__(self, per_layer: dict[int, dict[str, Any]], recipes: Sequence[Recipe],
                 options_of: Callable[[int], list[Option]], measure: Callable[[int], dict[str, Any] | None],
                 score: Callable[[int], None] | None = None,
                 measure_many: Callable[[list[int]], Iterable[tuple[int, dict[str, Any] | None]]] | None = None,
                 least_gain: float = 0.0, tied: Sequence[int] = ()) -> None:
        """`measure(i)`: layer i's floor; `measure_many(layers)`, when given, yields (i, floor) for all the layers one
        solution needs at once (side by side with a helper process, `infra.sidecar`). `deferred_skipped`: why no
        deferred candidate was scored, while none has been. `tied`: layers that take one candidate (`search.tie`)."""
        self.per_layer, self.recipes, self.options_of, self.measure, self.score = (per_layer, recipes, options_of,
                                                                                  measure, score)
        self.measure_many = measure_many
        self.least_gain = least_gain
        self.tied = tuple(tied)
        self.deferred_skipped: str | None = None
        self._scored_any = False
        self.options = {i: options_of(i) for i in per_layer}
        self.static = {str(r) for r in recipes if static_int8(r)}

    def _unscored(self, i: int) -> set[str]:
        return {r["recipe"] for r in self.per_layer[i]["candidates"] if r.get("deferred")}

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
            floors = [i for i, o in chosen.items()
                      if o.name in self.static and self.per_layer[i].get("ort_floor") == "pending"]
            if not floors and not unscored:
                return chosen
            if unscored and self.score is None:
                raise ValueError("FloorSearch: deferred candidates without a `score` to score them")
            if unscored:
                self.deferred_skipped = None  # some are scored: "none was" no longer holds
                self._scored_any = True
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
