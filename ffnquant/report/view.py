"""Small read-only helpers on a run report document, shared by its plots and its Markdown."""

from __future__ import annotations

from typing import Any, Mapping

from ..measure.recommend import Point, join_points

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


def _all_points(doc: Mapping[str, Any]) -> list[Point]:
    """The run's latency x accuracy points as stored in the document; one written before they were stored
    gets the same join the run makes (`recommend.join_points`), so its figures are those it always showed."""
    stored = doc["timing"].get("points")
    if stored is None:
        return join_points(doc["timing"]["latency"]["cases"], doc["accuracy"]["rows"], _baseline(doc))
    return [Point.from_dict(p) for p in stored]


def _points(doc: Mapping[str, Any], runtime: str, tokens: int, variant: str) -> list[Point]:
    """Latency/accuracy points of one panel; the baseline is exact (SQNR None)."""
    return [p for p in _all_points(doc) if (p.runtime, p.tokens, p.variant) == (runtime, tokens, variant)]
