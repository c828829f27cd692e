"""Stage: what the measurements say. Range section and claims, recommendations, findings (pure functions of rows)."""

from __future__ import annotations

import math
import statistics
import time  # noqa: F401 - the clock timing.time_calls reads; tests replace its perf_counter through this module
from typing import Any, Mapping, Sequence

from .. import ranges as R
from ..measure.latency import timing_suspect
from ..measure.recommend import Point, crest_cost_finding, pareto_front, recommend_all
from ..measure.timing import time_calls
from ..recipe import Recipe
from ..report.ranges import range_report_markdown

__all__ = ["range_section", "compact_histogram", "activation_time_claim", "recommendations", "findings",
           "ort_baseline_summary"]

STATIC_INT8 = ("w8a8", "w8a8-s8")


def compact_histogram(hist: Any, max_bins: int = 256) -> dict[str, list] | None:
    """The observer's histogram folded to at most `max_bins` bins, with empty tails trimmed (for plots)."""
    import numpy as np

    counts = np.asarray(hist.counts, dtype=np.int64)
    edges = np.asarray(hist.edges, dtype=np.float64)
    if counts.sum() == 0:
        return None
    nz = np.nonzero(counts)[0]
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    counts, edges = counts[lo:hi], edges[lo : hi + 1]
    factor = max(1, math.ceil(len(counts) / max_bins))
    pad = (-len(counts)) % factor
    if pad:
        counts = np.concatenate([counts, np.zeros(pad, dtype=np.int64)])
        step = edges[-1] - edges[-2]
        edges = np.concatenate([edges, edges[-1] + step * np.arange(1, pad + 1)])
    folded = counts.reshape(-1, factor).sum(axis=1)
    return {"edges": [float(e) for e in edges[::factor]], "counts": [int(c) for c in folded]}


def range_section(tables: Mapping[str, Any], meta: Mapping[str, Any]) -> tuple[dict, list[dict]]:
    """The report's `ranges` object and the range claims, from the range tables by variant (or layer key);
    `meta` says where the tokens came from and the synthetic weights' seed."""
    variants = {}
    for v, table in tables.items():
        summ = table.summary()
        variants[v] = {
            "sites": summ["sites"],
            "weights": summ["weights"],
            "hidden_histogram": compact_histogram(table["hidden"].histogram) if "hidden" in table else None,
            "n_tokens": table.n_tokens,
        }
    section: dict[str, Any] = {"status": "ok", "reason": None, "variants": variants, "findings": [], "markdown": None}
    section["findings"] = [f["text"] if isinstance(f, dict) else str(f) for f in R.findings(tables)]
    claims = [{"claim": str(c["claim"]), "status": str(c["status"]), "figure": str(c.get("detail", "")),
               "source": str(c.get("source", "ffnquant.ranges"))} for c in R.claims(tables)]
    # The range report's full Markdown (per-site tables, weights), nested under the report's own section.
    section["markdown"] = range_report_markdown(tables, meta, heading_level=3)
    return section, claims


def activation_time_claim(model: Any, tokens: Any, repeats: int = 7) -> dict[str, Any]:
    """Time the nonlinearity alone against the whole FFN forward (torch, CPU), median of a few repeats.

    The verdict holds only beyond the timings' spread (the activation's p10 over the forward's p90 for
    'contradicted', its p90 over the forward's p10 for 'confirmed'), and never from a timing flagged as not to be
    trusted (`latency.timing_suspect`): a busy machine makes it 'not measured', not a flipped verdict."""
    import numpy as np
    import torch

    with torch.no_grad():
        pre = (model.w_gate if model.w_gate is not None else model.w_up)(tokens)
        act = time_calls(lambda: model.activation(pre), repeats, warmup=1)
        ffn = time_calls(lambda: model(tokens), repeats, warmup=1)
    t_act, t_ffn = statistics.median(act), statistics.median(ffn)
    (act_lo, act_hi), (ffn_lo, ffn_hi) = np.percentile(act, [10, 90]), np.percentile(ffn, [10, 90])
    share = t_act / t_ffn
    suspect = timing_suspect(len(act)) or timing_suspect(len(ffn))
    if suspect is None and act_hi / ffn_lo <= 0.015:
        status = "confirmed"
    elif suspect is None and act_lo / ffn_hi > 0.015:
        status = "contradicted"
    else:
        status = "not measured"
        suspect = suspect or "the timings' spread straddles 1.5%"
    v = model.spec.variant.value
    return {
        "claim": f"the activation is at most about 1% of the FFN's wall-clock time ({v})",
        "status": status,
        "figure": f"{1e6 * t_act:.0f} us of {1e6 * t_ffn:.0f} us at M={tokens.shape[0]} in torch on CPU: {100 * share:.1f}%"
                  + (f" (timing suspect: {suspect})" if status == "not measured" else ""),
        "source": "ffnquant.pipeline (torch timing)",
    }


def recommendations(points: Sequence[Point], *, target_db: float, baseline: str) -> tuple[list[dict], list[dict]]:
    """(recommendations, Pareto fronts) from the run's latency x accuracy points (`recommend.join_points`)."""
    recs = [r.to_dict() for r in recommend_all(points, target_db, baseline)]
    groups: dict[tuple, list] = {}
    for p in points:
        groups.setdefault((p.variant, p.runtime, p.tokens), []).append(p)
    pareto = [{"variant": v, "runtime": rt, "tokens": t, "schemes": [p.scheme for p in pareto_front(pts)]}
              for (v, rt, t), pts in sorted(groups.items())]
    return recs, pareto


def findings(ranges: Mapping[str, Any], rows: Sequence[dict], recipes: Sequence[Recipe],
             model_doc: Mapping[str, Any] | None, *, variants: Sequence[str]) -> list[dict]:
    """The report's findings: crest factor against int8 cost (synthetic family, the run's `variants`), remedy
    gains, the model's layers."""
    out = []
    # the crest/cost relation is a claim about the synthetic family; a real model's layers get their own finding
    crest = {v: ranges["variants"][v]["sites"].get("hidden", {}).get("crest_factor") for v in ranges["variants"]
             if v in variants}
    crest = {v: c for v, c in crest.items() if c is not None}
    plain_static = next((r for r in recipes if r.scheme in STATIC_INT8 and not r.has_remedies), None)
    if plain_static is not None:
        sq = {r["variant"]: r["sqnr_db"] for r in rows if r["scheme"] == plain_static.name and r["sqnr_db"] is not None
              and r["variant"] in variants}
        f = crest_cost_finding(crest, sq, scheme=plain_static.label)
        if f is not None:
            out.append(f)
    out += remedy_findings(rows, recipes)
    if model_doc is not None:
        f = model_finding(model_doc, rows, recipes, variants, ranges["variants"])
        if f is not None:
            out.append(f)
    return out


def remedy_findings(rows: Sequence[dict], recipes: Sequence[Recipe]) -> list[dict]:
    """What smoothing bought per variant, from the accuracy rows (only where it applied)."""
    out = []
    for recipe in recipes:
        if recipe.smooth is None:
            continue
        plain = recipe.plain().name
        gains = []
        refused = []
        # one note per distinct text, naming every variant (or model layer) it applies to
        by_note: dict[str, list[str]] = {}
        for r in rows:
            if r["scheme"] == recipe.name:
                for rem in r.get("remedies", []):
                    if rem.get("note") and r["variant"] not in by_note.setdefault(rem["note"], []):
                        by_note[rem["note"]].append(r["variant"])
        notes = sorted(f"{', '.join(vs)}: {note}" for note, vs in by_note.items())
        for r in rows:
            if r["scheme"] != recipe.name:
                continue
            if r["status"] == "not applicable":
                refused.append(r["variant"])
                continue
            base = next((b for b in rows if b["variant"] == r["variant"] and b["scheme"] == plain), None)
            if base and base["sqnr_db"] is not None and r["sqnr_db"] is not None:
                gains.append((r["variant"], r["sqnr_db"] - base["sqnr_db"]))
        if gains:
            text = f"{recipe.label} vs {plain}: " + ", ".join(f"{v} {g:+.1f} dB" for v, g in gains)
            if refused:
                text += f"; not applied to {', '.join(refused)} (the fold is not exact for their nonlinearity)"
            if notes:
                text += "; " + "; ".join(notes)
            out.append({"text": text, "gains_db": dict(gains), "refused": refused})
    return out


def model_finding(model: Mapping[str, Any], rows: Sequence[dict], recipes: Sequence[Recipe], variants: Sequence[str],
                  ranges: Mapping[str, Any]) -> dict | None:
    """The model's layers against the random-weight variant of its family under the first static int8 recipe
    (or the first quantized one), with the end-to-end figure: the side-by-side in one sentence."""
    keys = [l["key"] for l in model["layers"]]
    order = [r for r in recipes if r.scheme in STATIC_INT8 and not r.has_remedies] + list(recipes)
    for recipe in order:
        sq = {r["variant"]: r["sqnr_db"] for r in rows if r["scheme"] == recipe.name and r["status"] == "ok"
              and r["sqnr_db"] is not None}
        layer_sq = {k: sq[k] for k in keys if k in sq}
        if not layer_sq:
            continue
        lo = min(layer_sq, key=layer_sq.get)
        text = (f"{model['model_type']} ({model['variant']}, d_model {model['spec']['d_model']}) under {recipe.label}: "
                f"per-layer SQNR {min(layer_sq.values()):.1f} to {max(layer_sq.values()):.1f} dB on held-out text "
                f"inputs (lowest {lo}, hidden crest factor "
                f"{ranges.get(lo, {}).get('sites', {}).get('hidden', {}).get('crest_factor') or float('nan'):.0f})")
        same = model["variant"] if model["variant"] in variants else None
        if same is not None and sq.get(same) is not None:
            crest = ranges.get(same, {}).get("sites", {}).get("hidden", {}).get("crest_factor")
            text += f", against {sq[same]:.1f} dB for the random-weight {same} variant" + (
                f" (crest {crest:.0f})" if crest is not None else "")
        e2e = next((s for s in model["end_to_end"]["schemes"] if s["scheme"] == recipe.name), None)
        if e2e is not None:
            e = e2e["end_to_end"]
            text += f"; every layer quantized, the model's final hidden state keeps {e['hidden_sqnr_db']:.1f} dB SQNR"
            if e.get("perplexity_delta") is not None:
                text += f" and perplexity changes by {e['perplexity_delta']:+.3g}"
        return {"text": text, "scheme": recipe.name, "layers_sqnr_db": layer_sq}
    return None


def ort_baseline_summary(baselines: Sequence[dict], rows: Sequence[dict], recipes: Sequence[Recipe]) -> dict | None:
    """onnxruntime's default quantize_static against ffnquant's best static int8 recipe, per variant."""
    if not baselines:
        return None
    static = [r.name for r in recipes if r.scheme in STATIC_INT8]

    def db(r: dict) -> float | None:
        return r["onnx_sqnr_db"] if r.get("onnx_sqnr_db") is not None else r["sqnr_db"]

    per_variant = []
    for b in baselines:
        ours = [r for r in rows if r["variant"] == b["variant"] and r["scheme"] in static and r["status"] == "ok"
                and db(r) is not None]
        best = max(ours, key=db, default=None)
        per_variant.append({"variant": b["variant"], "ort_default_sqnr_db": b["sqnr_db"],
                            "ours": best["label"] if best else None, "ours_sqnr_db": db(best) if best else None})
    parts = [f"{p['variant']} {p['ort_default_sqnr_db']:.1f} dB vs ffnquant's {p['ours']} {p['ours_sqnr_db']:.1f} dB"
             for p in per_variant if p["ours_sqnr_db"] is not None and p["ort_default_sqnr_db"] is not None]
    text = "; ".join(parts) + " (both on onnxruntime's CPU provider, same data)" if parts else ""
    return {"what": baselines[0]["what"], "variants": per_variant, "text": text}
