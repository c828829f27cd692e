"""Stage: every recipe of one FFN quantized, exported and scored (a synthetic variant or a model's layer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import FFNQuantError
from ..quantization import quantize_recipes as quantize_each, sensitivity
from ..recipe import Recipe
from ..schemes import recipe_weight_bytes
from ..spec import FFNSpec
from .results import VariantResult, json_num

if TYPE_CHECKING:  # annotations only
    from ..quantization import Prepared

__all__ = ["Scoring", "score_recipes"]


@dataclass(frozen=True)
class Scoring:
    """What scoring the recipes of one FFN reads of a run's config: the seed, the float baseline's recipe
    name (exact by definition, not scored) and whether the worst cases get their per-site sensitivity."""

    seed: int
    baseline: str
    sensitivity: bool

    def __post_init__(self) -> None:
        if not isinstance(self.sensitivity, bool) or not self.baseline:
            raise FFNQuantError(f"scoring needs a baseline name and sensitivity true or false, got {self!r}")


def _sensitivity(prep: Prepared, res: Any) -> dict[str, float | None]:
    """SQNR with one weight or one activation site quantized as in `res`, the rest float (quantize.sensitivity)."""
    return {k: json_num(v) for k, v in sensitivity(prep, res.qmodel).items()}


def _row(label: str, recipe: Recipe, spec: FFNSpec) -> dict[str, Any]:
    return {"variant": label, "scheme": recipe.name, "label": recipe.label, "status": "ok", "reason": None,
            "sqnr_db": None, "cosine": None, "rel_l2": None, "max_abs_error": None,
            "size_bytes": recipe_weight_bytes(spec, recipe), "onnx_sqnr_db": None, "site_ranges": {},
            "sensitivity": None}


def score_recipes(
    spec: FFNSpec, model: Any, recipes: Sequence[Recipe], scoring: Scoring, calib: Any, eval_tokens: Any,
    out_export: Path | None, tick: Callable[[str], None], label: str | None = None, stem: str | None = None,
    keep: bool = False,
) -> VariantResult:
    """Every recipe of one FFN through `quantization.quantize_recipes`: accuracy rows (torch reference and the
    ONNX artifact on onnxruntime), artifacts written to `out_export`, and onnxruntime's default
    quantize_static on the same model and data for comparison.

    `quantization.quantize_recipes` calibrates once per remedy set, shared by the recipes that use it. A real
    model's layer passes its report key as `label` (e.g. 'bert:L0') and its ONNX file stem as `stem`;
    `keep` collects the quantized FFN of every quantized recipe for the end-to-end run.
    """
    v = label or spec.variant.value
    out = VariantResult([], [], {}, None)
    work: dict[str, Any] = {}  # recipe name -> (prepared, QuantResult) for the sensitivity of the worst cases
    outcomes = quantize_each(spec, recipes, collect_errors=True, model=model, calib_tokens=calib,
                             eval_tokens=eval_tokens, seed=scoring.seed, name=stem, out_artifacts=out_export,
                             onnx=out_export is not None, baseline=out_export is not None)
    for o in outcomes:
        recipe, res, prep = o.recipe, o.result, o.prepared
        row = _row(v, recipe, spec)
        if o.error is not None:
            # a remedy that cannot apply exactly to this FFN is refused by design; anything else is a
            # broken combination that must not sink the run: both are recorded in the report
            bad = isinstance(o.error, FFNQuantError)
            row.update(status="not applicable" if bad else "error",
                       reason=str(o.error) if bad else f"{type(o.error).__name__}: {o.error}")
        else:
            _fill_row(row, recipe, res, prep, recipe.name == scoring.baseline)
            if recipe.name != scoring.baseline:
                work[recipe.name] = (prep, res)
                if keep:
                    out.kept[recipe.name] = res.qmodel
            art = res.artifact or {}
            if art.get("path"):
                p = Path(art["path"])
                out.paths[recipe.name] = p
                # the staged path for now: `run` puts the final one in once every artifact is written
                out.artifacts.append({"variant": v, "scheme": recipe.name, "path": p,
                                      "size_bytes": int(art["size_bytes"]), "format": str(art.get("kind"))})
            elif art.get("note") and art.get("kind") is None:
                row["reason"] = f"no ONNX artifact: {art['note']}"
            if res.baseline and out.ort_baseline is None:
                out.ort_baseline = {"variant": v, "what": res.baseline["what"],
                                    "sqnr_db": json_num(res.baseline["accuracy_onnx"]["sqnr_db"]),
                                    "size_bytes": res.baseline.get("size_bytes")}
        out.rows.append(row)
        tick(f"{v} {recipe.name}")
    if scoring.sensitivity:
        _worst_sensitivity(out.rows, work)
    return out


def _fill_row(row: dict[str, Any], recipe: Recipe, res: Any, prep: Prepared, is_baseline: bool) -> None:
    acc = res.accuracy
    if is_baseline:
        row.update(sqnr_db=None, cosine=1.0, rel_l2=0.0, max_abs_error=0.0)
    else:
        row.update(sqnr_db=json_num(acc.sqnr_db), cosine=json_num(acc.cosine), rel_l2=json_num(acc.rel_l2),
                   max_abs_error=json_num(acc.max_abs_error))
    row["site_ranges"] = {s: {"lo": r.lo, "hi": r.hi, "calibrator": r.calibrator} for s, r in res.ranges.items()}
    if prep.remedies:
        row["remedies"] = [{"kind": r.kind, "params": r.params, "exact": r.exact, "note": r.note} for r in prep.remedies]
    art = res.artifact or {}
    if art.get("accuracy_onnx") and not is_baseline:
        row["onnx_sqnr_db"] = json_num(art["accuracy_onnx"]["sqnr_db"])
        if art.get("accuracy_onnx_graph"):  # this CPU's int8 kernel saturates (ortcpu): the graph's own figure too
            row.update(onnx_graph_sqnr_db=json_num(art["accuracy_onnx_graph"]["sqnr_db"]), int8_kernel=art["int8_kernel"])


def _worst_sensitivity(rows: list[dict], work: dict[str, Any]) -> None:
    """Per-site sensitivity of the worst cases: the two least accurate quantized recipes of the FFN."""
    ranked = sorted((r for r in rows if r["status"] == "ok" and r["sqnr_db"] is not None and r["scheme"] in work),
                    key=lambda r: r["sqnr_db"])[:2]
    for r in ranked:
        prep, res = work[r["scheme"]]
        try:
            r["sensitivity"] = _sensitivity(prep, res)
        except Exception as exc:  # recorded, not fatal
            r["reason"] = f"sensitivity failed: {type(exc).__name__}: {exc}"
