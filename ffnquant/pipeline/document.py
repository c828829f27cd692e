"""The report document of a run, assembled from the stages' results (nothing is measured here)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .. import __version__
from ..infra.envinfo import environment
from ..measure.recommend import Point
from ..recipe import Recipe
from ..report import SCHEMA_NAME, SCHEMA_VERSION
from ..spec import FFNSpec
from .findings import ort_baseline_summary

__all__ = ["build_document"]


def build_document(
    config: Mapping[str, Any], specs: Sequence[FFNSpec], recipes: Sequence[Recipe], calib_tokens: int,
    eval_tokens: int, command: str, source: Any, model_doc: Mapping[str, Any] | None, ranges: Mapping[str, Any],
    claims: Sequence[dict], rows: Sequence[dict], ort_baselines: Sequence[dict], artifacts: Sequence[dict],
    findings: Sequence[dict], missing: Sequence[dict], latency: Mapping[str, Any], points: Sequence[Point], recommendations: Sequence[dict],
    pareto: Sequence[dict], timed_claims: Sequence[dict], stages: Mapping[str, float], wall_s: float,
) -> dict[str, Any]:
    """The JSON document `report.write_report` renders (schema `ffnquant-report` v1). `config` is the run's
    config in its written form (`RunConfig.to_dict`), copied as is; the values read here come as arguments."""
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "ffnquant_version": __version__,
        "command": command,
        "config": dict(config),
        "environment": environment(),
        "specs": [dict(s.to_dict(), key=s.key, n_params=s.n_params, flops_per_token=s.flops_per_token) for s in specs],
        "data": {
            "source": source.label,
            "calib_tokens": calib_tokens,
            "eval_tokens": eval_tokens,
            "separation": "held-out tokens never used for calibration: "
                          + ("rows after the calibration rows of the file" if source.kind.value == "file"
                             else "an independent random stream of the same source"),
        },
        **({"model": dict(model_doc)} if model_doc is not None else {}),
        "ranges": ranges,
        "claims": list(claims),
        "accuracy": {"status": "ok" if rows else "missing", "reason": None if rows else "no recipe was quantized",
                     "rows": list(rows), "baseline": ort_baseline_summary(ort_baselines, rows, recipes)},
        "artifacts": list(artifacts),
        "findings": list(findings),
        "missing": list(missing),
        "timing": {
            "wall_s": round(wall_s, 3),
            "stages": {k: round(v, 3) for k, v in stages.items()},
            "latency": latency,
            "points": [p.to_dict() for p in points],
            "recommendations": list(recommendations),
            "pareto": list(pareto),
            "claims": list(timed_claims),
        },
    }
