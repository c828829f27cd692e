"""onnxruntime's floor under a plan: a static int8 candidate below onnxruntime's best own quantizer on its layer
(quantize_static MinMax / Percentile / Entropy, quantize_dynamic) is left out, and the floor is measured on a layer
only once a solution picks a static int8 candidate there (`FloorSearch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..infra.atomic import ScratchFolder
from ..numerics.accuracy import run_batched
from ..onnx.export import export_onnx
from ..onnx.ortbaseline import ort_baselines
from ..recipe import Recipe
from .search import Option, solve

__all__ = ["ort_best", "ort_exclude", "static_int8", "FloorSearch"]


def ort_best(layer: Any, calib: torch.Tensor, held: torch.Tensor, settings: Any) -> dict[str, Any] | None:
    """onnxruntime's best own quantizer of this layer (quantize_static MinMax / Percentile / Entropy and
    quantize_dynamic, on the same calibration and held-out inputs): {method, sqnr_db, methods}, or None."""
    with ScratchFolder("plan-ort") as folder:  # marked: a killed run's is swept by the next run
        fp32 = Path(folder) / f"{layer.label}.fp32.onnx"
        export_onnx(layer.ffn, fp32)
        with torch.no_grad():
            ref = run_batched(layer.ffn, held)
        res = ort_baselines(fp32, [calib[i : i + 1024] for i in range(0, calib.shape[0], 1024)], held, ref,
                            run_tokens=settings.seq_len * settings.batch_size)
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
        scheme = recipe.resolve()
        if scheme.static_activations and scheme.act_dtype.is_integer and row["layer_sqnr_db"] < best["sqnr_db"]:
            row["excluded"] = (f"below onnxruntime's best own quantizer on this layer ({row['layer_sqnr_db']:.1f} dB < "
                               f"{best['sqnr_db']:.1f} dB, {best['method']})")


def static_int8(recipe: Recipe) -> bool:
    """Whether `recipe` quantizes activations to integers with static (calibrated) ranges."""
    scheme = recipe.resolve()
    return scheme.static_activations and scheme.act_dtype.is_integer


class FloorSearch:
    """`search.solve` with onnxruntime's floor measured only where it can matter.

    A static int8 candidate below onnxruntime's best own quantizer on its layer is left out (`ort_exclude`).
    Measuring that floor costs seconds per layer, so it is measured on a layer only once a solution picks a
    static int8 candidate there; the layer's options are then pruned and the search solved again. The result is
    the one an eager floor gives: a solution that picks no unmeasured static int8 candidate is optimal with fewer
    exclusions, so it is also optimal with all of them."""

    def __init__(self, options: dict[int, list[Option]], per_layer: dict[int, dict[str, Any]],
                 recipes: Sequence[Recipe], measure: Callable[[int], dict[str, Any] | None]) -> None:
        self.options, self.per_layer, self.recipes, self.measure = options, per_layer, recipes, measure
        self.static = {str(r) for r in recipes if static_int8(r)}

    def solve(self, budget: float) -> dict[int, Option] | None:
        while True:
            chosen = solve(self.options, budget)
            if chosen is None:
                return None
            todo = [i for i, o in chosen.items()
                    if o.name in self.static and self.per_layer[i].get("ort_floor") == "pending"]
            if not todo:
                return chosen
            for i in todo:
                entry = self.per_layer[i]
                entry["ort_best"] = best = self.measure(i)
                entry["ort_floor"] = "measured"
                ort_exclude(best, self.recipes, entry["candidates"])
                left = {r["recipe"] for r in entry["candidates"] if r.get("error") is None and "excluded" not in r}
                self.options[i] = [o for o in self.options[i] if o.name in left]
