"""Small read-only helpers on a run report document, shared by its plots and its Markdown."""

from __future__ import annotations

from typing import Any, Mapping

from ..recommend import Point

def _ok_cases(doc: Mapping[str, Any]) -> list[dict]:
    return [c for c in doc["timing"]["latency"]["cases"] if c.get("error") is None and c.get("median_s")]


def _accuracy_index(doc: Mapping[str, Any]) -> dict[tuple[str, str], dict]:
    return {(r["variant"], r["scheme"]): r for r in doc["accuracy"]["rows"]}


def _variants(doc: Mapping[str, Any]) -> list[str]:
    return [s["variant"] for s in doc["specs"]]


def _keys(doc: Mapping[str, Any]) -> list[str]:
    """The report's rows: the synthetic variants, then a real model's layers ('<model_type>:L<k>') if any."""
    model = doc.get("model") or {}
    return _variants(doc) + [layer["key"] for layer in model.get("layers", [])]


def _runtimes_with_cases(doc: Mapping[str, Any]) -> list[str]:
    seen: list[str] = []
    for c in _ok_cases(doc):
        if c["runtime"] not in seen:
            seen.append(c["runtime"])
    return seen


def _scheme_order(doc: Mapping[str, Any]) -> list[str]:
    order = list(doc["config"].get("schemes", []))
    for r in doc["accuracy"]["rows"]:
        if r["scheme"] not in order:
            order.append(r["scheme"])
    for c in doc["timing"]["latency"]["cases"]:
        if c["scheme"] not in order:
            order.append(c["scheme"])
    return order


def _baseline(doc: Mapping[str, Any]) -> str:
    return str(doc["config"].get("baseline", "fp32"))


def _points(doc: Mapping[str, Any], runtime: str, tokens: int, variant: str) -> list[Point]:
    """Latency/accuracy points of one panel; the baseline is exact (SQNR None)."""
    acc = _accuracy_index(doc)
    base = _baseline(doc)
    pts = []
    for c in _ok_cases(doc):
        if (c["runtime"], c["tokens"], c["variant"]) != (runtime, tokens, variant):
            continue
        row = acc.get((variant, c["scheme"]))
        if c["scheme"] == base:
            sqnr = None
        elif row is not None and row.get("status") == "ok" and row.get("sqnr_db") is not None:
            sqnr = float(row["sqnr_db"])
        else:
            continue
        pts.append(Point(variant, c["scheme"], runtime, tokens, float(c["median_s"]), sqnr,
                         row["label"] if row else c["scheme"], p10_s=c.get("p10_s") or None, p90_s=c.get("p90_s") or None,
                         suspect=c.get("suspect")))
    return pts
