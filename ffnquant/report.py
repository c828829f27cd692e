"""The run report: `report.json` (schema-versioned), `report.md` and a self-contained `report.html`.

Everything here renders a report *document* (a JSON-able dict, see
`ffnquant/data/report.schema.json`) built by `ffnquant.pipeline`; nothing is measured here.
Plots, Markdown and HTML are all produced in memory first and only then written, each file
atomically, so a failure while rendering leaves no report behind and an interruption while
writing leaves whole files only.

Determinism: equal seeds and inputs give equal documents except under `timing` (latency,
recommendations ranked by latency, wall times) and `environment.timestamp_utc`;
`strip_timing` removes exactly those.
"""

from __future__ import annotations

import base64
import copy
import html
import io
import json
import math
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .atomic import ensure_writable_dir, write_bytes, write_json, write_text
from .errors import FFNQuantError
from .recommend import Point, pareto_front
from .render import fmt, markdown_table

__all__ = [
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "PLOT_DIR",
    "report_schema",
    "validate_report",
    "strip_timing",
    "render_plots",
    "render_markdown",
    "render_html",
    "write_report",
]

SCHEMA_NAME = "ffnquant-report"
SCHEMA_VERSION = 1
PLOT_DIR = "report_plots"  # beside report.md, so the Markdown's relative image links work


# --- schema ------------------------------------------------------------------------------

def report_schema() -> dict[str, Any]:
    """The JSON Schema of `report.json` (shipped as package data)."""
    text = resources.files("ffnquant").joinpath("data/report.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def validate_report(doc: Mapping[str, Any]) -> None:
    """Check `doc` against the schema; raise FFNQuantError naming the first violation.

    Needs the `jsonschema` package (the test extra); it is not needed to write reports.
    """
    try:
        import jsonschema
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise FFNQuantError("validating a report needs the jsonschema package (pip install ffnquant[test])") from exc
    validator = jsonschema.Draft202012Validator(report_schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise FFNQuantError(f"report does not match schema v{SCHEMA_VERSION} at {where}: {err.message}")


def strip_timing(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `doc` without the clock-dependent parts, for comparing two runs."""
    out = copy.deepcopy(dict(doc))
    out.pop("timing", None)
    if isinstance(out.get("environment"), dict):
        out["environment"].pop("timestamp_utc", None)
    return out


# --- small helpers on the document ---------------------------------------------------------

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
                         row["label"] if row else c["scheme"]))
    return pts


# --- plots ---------------------------------------------------------------------------------

def _png(fig) -> bytes:
    buf = io.BytesIO()
    # Fixed metadata so that equal figures give equal bytes (matplotlib stamps the version otherwise).
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    cols = min(max_cols, max(1, n))
    return math.ceil(n / cols), cols


def _variant_panels(doc: Mapping[str, Any], variants: list[str], panel_height: float):
    """One subplot per variant (unused cells hidden), the schemes in report order and a colour per scheme."""
    import matplotlib.pyplot as plt

    rows, cols = _grid(len(variants))
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, panel_height * rows), squeeze=False)
    for ax in axes.flat[len(variants):]:
        ax.axis("off")
    schemes = _scheme_order(doc)
    colours = {s: plt.cm.tab10(i % 10) for i, s in enumerate(schemes)}
    return fig, list(zip(axes.flat, variants)), schemes, colours


def _plot_hidden_hist(doc: Mapping[str, Any]) -> bytes | None:
    import matplotlib.pyplot as plt
    import numpy as np

    hists = {v: d.get("hidden_histogram") for v, d in doc["ranges"]["variants"].items() if d.get("hidden_histogram")}
    if not hists:
        return None
    fig, ax = plt.subplots(figsize=(10, 5))
    for v, h in hists.items():
        edges = np.asarray(h["edges"], dtype=float)
        counts = np.asarray(h["counts"], dtype=float)
        std = doc["ranges"]["variants"][v]["sites"].get("hidden", {}).get("std") or 1.0
        # Normalise to densities over x/std so variants with different scales share one axis.
        widths = np.diff(edges) / std
        density = counts / max(counts.sum(), 1.0) / np.where(widths > 0, widths, 1.0)
        centres = (edges[:-1] + edges[1:]) / 2 / std
        ax.step(centres, np.where(density > 0, density, np.nan), where="mid", label=v, linewidth=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden value / std of hidden")
    ax.set_ylabel("density (log scale)")
    ax.set_title("`hidden` (the down projection's input) per variant")
    ax.grid(True, alpha=0.3)
    ax.legend(ncol=3, fontsize=8)
    return _png(fig)


def _plot_crest_kurtosis(doc: Mapping[str, Any]) -> bytes | None:
    import matplotlib.pyplot as plt
    import numpy as np

    variants = [v for v in _variants(doc) if v in doc["ranges"]["variants"]]
    if not variants:
        return None
    sites = [s for s in ("input", "gate_pre", "up", "act", "hidden", "output")
             if any(s in doc["ranges"]["variants"][v]["sites"] for v in variants)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(variants)
    x = np.arange(len(sites))
    for stat, ax in zip(("crest_factor", "kurtosis"), axes):
        for i, v in enumerate(variants):
            vals = [doc["ranges"]["variants"][v]["sites"].get(s, {}).get(stat) for s in sites]
            ax.bar(x + (i - (len(variants) - 1) / 2) * width, [np.nan if a is None else a for a in vals], width, label=v)
        ax.set_xticks(x, sites)
        ax.set_title({"crest_factor": "crest factor (absmax / std)", "kurtosis": "kurtosis"}[stat])
        ax.grid(True, axis="y", alpha=0.3)
        if stat == "kurtosis":
            ax.set_yscale("log")
    axes[0].legend(ncol=3, fontsize=7)
    return _png(fig)


def _plot_scatter(doc: Mapping[str, Any], runtime: str, tokens: int) -> bytes | None:
    target = float(doc["config"].get("target_db", 30.0))
    variants = [v for v in _keys(doc) if _points(doc, runtime, tokens, v)]
    if not variants:
        return None
    fig, panels, schemes, colours = _variant_panels(doc, variants, panel_height=3.6)
    for ax, v in panels:
        pts = _points(doc, runtime, tokens, v)
        quant = [p for p in pts if p.sqnr_db is not None]
        for p in quant:
            ax.scatter(p.latency_s * 1e3, p.sqnr_db, color=colours[p.scheme], s=36, zorder=3)
            ax.annotate(p.scheme, (p.latency_s * 1e3, p.sqnr_db), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = pareto_front(quant)
        if len(front) > 1:
            ax.plot([p.latency_s * 1e3 for p in front], [p.sqnr_db for p in front], "k--", linewidth=1, zorder=2,
                    label="Pareto front")
        elif front:
            ax.scatter([front[0].latency_s * 1e3], [front[0].sqnr_db], facecolors="none", edgecolors="k", s=120,
                       label="Pareto front")
        base = next((p for p in pts if p.sqnr_db is None), None)
        if base is not None:
            ax.axvline(base.latency_s * 1e3, color="grey", linestyle=":", label=f"{base.scheme} latency")
        ax.axhline(target, color="tab:red", linestyle="-.", linewidth=0.8, label=f"target {target:g} dB")
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis)
        ax.set_title(v, fontsize=10)
        ax.set_xlabel("median latency (ms, log)", fontsize=8)
        ax.set_ylabel("SQNR (dB)", fontsize=8)
        ax.grid(True, alpha=0.3)
    panels[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"accuracy vs latency on {runtime} at M={tokens} tokens (higher and further left is better)")
    fig.tight_layout()
    return _png(fig)


def _plot_latency_tokens(doc: Mapping[str, Any], runtime: str) -> bytes | None:
    cases = [c for c in _ok_cases(doc) if c["runtime"] == runtime]
    variants = [v for v in _keys(doc) if any(c["variant"] == v for c in cases)]
    if not variants:
        return None
    fig, panels, schemes, colours = _variant_panels(doc, variants, panel_height=3.4)
    for ax, v in panels:
        for s in schemes:
            pts = sorted((c["tokens"], c["median_s"]) for c in cases if c["variant"] == v and c["scheme"] == s)
            if pts:
                ax.plot([t for t, _ in pts], [m * 1e3 for _, m in pts], "o-", color=colours[s], label=s, markersize=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log_axis(ax.xaxis)
        _plain_log_axis(ax.yaxis)
        ax.set_title(v, fontsize=10)
        ax.set_xlabel("tokens M (log)", fontsize=8)
        ax.set_ylabel("median latency (ms, log)", fontsize=8)
        ax.grid(True, alpha=0.3)
    panels[0][0].legend(fontsize=7)
    fig.suptitle(f"latency vs tokens on {runtime}")
    fig.tight_layout()
    return _png(fig)


def _plain_log_axis(axis) -> None:
    """Log-scale ticks as plain numbers without minor labels (the default '3x10^0' labels overlap)."""
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(StrMethodFormatter("{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "_", text).strip("_").lower()


def render_plots(doc: Mapping[str, Any]) -> dict[str, bytes]:
    """All plots of the report as PNG bytes keyed by file name (only those with data to show)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe when a GUI backend was chosen before
    plots: dict[str, bytes | None] = {
        "hidden_hist.png": _plot_hidden_hist(doc),
        "crest_kurtosis.png": _plot_crest_kurtosis(doc),
    }
    primary = doc["timing"]["latency"].get("primary_tokens")
    for rt in _runtimes_with_cases(doc):
        if primary is not None:
            plots[f"scatter_{_slug(rt)}.png"] = _plot_scatter(doc, rt, int(primary))
        plots[f"latency_tokens_{_slug(rt)}.png"] = _plot_latency_tokens(doc, rt)
    return {k: v for k, v in plots.items() if v is not None}


# --- Markdown ------------------------------------------------------------------------------

def _db(x: Any) -> str:
    return "-" if x is None else f"{float(x):.1f}"


def _ms(x: Any) -> str:
    return "-" if x is None else f"{float(x) * 1e3:.3g}"


def _img(plots: Mapping[str, bytes], name: str, alt: str) -> list[str]:
    return [f"![{alt}]({PLOT_DIR}/{name})", ""] if name in plots else []


def _section_header(doc: Mapping[str, Any]) -> list[str]:
    cfg, env = doc["config"], doc["environment"]
    gpu = env.get("gpu")
    machine = f"{env.get('cpu', '?')} ({env.get('cpu_count', '?')} cores)" + (f", GPU {gpu['name']}" if gpu else ", no GPU")
    lines = [
        "# ffnquant report: FFN quantization accuracy and latency",
        "",
        f"Made by: `{doc['command']}`",
        "",
        f"- ffnquant {doc['ffnquant_version']}, report schema v{doc['schema_version']}, "
        f"{env.get('timestamp_utc', '')}, wall time {doc['timing']['wall_s']:.1f} s",
        f"- machine: {machine}; torch {env.get('packages', {}).get('torch')}, onnxruntime "
        f"{env.get('packages', {}).get('onnxruntime-gpu') or env.get('packages', {}).get('onnxruntime')}",
        f"- variants: {', '.join(_variants(doc))} at d_model {cfg.get('d_model')}",
        *([_model_line(doc["model"])] if doc.get("model") else []),
        f"- data: {doc['data']['source']}, {doc['data']['calib_tokens']} calibration and {doc['data']['eval_tokens']} "
        f"held-out tokens ({doc['data']['separation']})",
        f"- schemes: {', '.join(cfg.get('schemes', []))}; accuracy target SQNR >= {cfg.get('target_db')} dB; "
        f"seed {cfg.get('seed')}",
        "",
    ]
    if doc["missing"]:
        lines += ["**Not in this report:**", ""]
        lines += [f"- {m['part']}: {m['reason']}" for m in doc["missing"]]
        lines.append("")
    return lines


def _model_line(model: Mapping[str, Any]) -> str:
    spec = model["spec"]
    labels = [layer["label"] for layer in model["layers"]]
    return (f"- real model: `{model['path']}` ({model['model_type']}, {model['variant']} FFN, d_model {spec['d_model']}, "
            f"d_ff {spec['d_ff']}); layers {', '.join(labels)} of {model['n_ffns']} reported as "
            f"{model['model_type']}:L<k> next to the variants; inputs captured from {model['calibration']['source']} "
            f"(calibration) and {model['evaluation']['source']} (held out)")


def _section_model(doc: Mapping[str, Any]) -> list[str]:
    """The real model's layers per scheme side by side with the variant of its family, and end to end."""
    model = doc.get("model")
    if not model:
        return []
    keys = [layer["key"] for layer in model["layers"]]
    acc = _accuracy_index(doc)
    schemes = [s for s in _scheme_order(doc) if s != _baseline(doc)]
    same = model["variant"] if model["variant"] in _variants(doc) else None
    lines = [f"## Real model: {model['model_type']} layers next to the variants", "",
             f"`{model['path']}`: {model['kind']}, {model['variant']} FFN (config activation "
             f"`{model['hf_activation']}`), d_model {model['spec']['d_model']}, d_ff {model['spec']['d_ff']}. "
             f"Each layer is quantized like a synthetic variant (same schemes, calibrators and remedies), calibrated on "
             f"its own inputs from {model['calibration']['source']} and measured on held-out inputs "
             f"({model['evaluation']['separation']}). SQNR dB of the FFN output:", ""]
    head = ["scheme"] + [layer["label"] for layer in model["layers"]] + ([f"{same} (random weights, d_model "
                                                                          f"{doc['config'].get('d_model')})"] if same else [])
    rows = []
    for s in schemes:
        cells = []
        for k in keys + ([same] if same else []):
            r = acc.get((k, s))
            cells.append("-" if r is None else (_db(r["sqnr_db"]) if r["status"] == "ok" else "skipped"))
        label = next((r["label"] for k in keys if (r := acc.get((k, s)))), s)
        rows.append([label] + cells)
    lines += [markdown_table(head, rows), ""]
    for sk in model["skipped"]:
        lines.append(f"- skipped {sk['scheme']} on {', '.join(sk['layers'])}: {sk['reason']}")
    if model["skipped"]:
        lines.append("")
    borrowed = [layer for layer in model["layers"] if layer.get("inputs_borrowed")]
    lines += [f"- {layer['label']}: {layer['inputs_borrowed']}" for layer in borrowed] + ([""] if borrowed else [])
    e2e = model["end_to_end"]
    lines += ["### End to end", ""]
    if e2e["status"] != "ok":
        lines += [f"Not measured: {e2e['reason']}", ""]
    elif e2e["schemes"]:
        base = e2e["baseline"]
        causal = base.get("perplexity") is not None
        lines += [f"Every selected layer quantized with the scheme and put back into the model, on {base['n_tokens']} tokens "
                  f"of {e2e['evaluation_text']}" + (f" (float perplexity {fmt(base['perplexity'])})" if causal else "")
                  + "; the last column is the layer that hurts most when quantized alone.", ""]
        head = ["scheme", "final hidden SQNR dB", "cosine"] + (["perplexity", "Δ perplexity"] if causal else []) + ["hurts most"]
        rows = []
        for s in e2e["schemes"]:
            e = s["end_to_end"]
            rows.append([s["label"], _db(e["hidden_sqnr_db"]), e["hidden_cosine"]]
                        + ([e.get("perplexity"), e.get("perplexity_delta")] if causal else [])
                        + [", ".join(s["worst_layers_end_to_end"][:1]) or "-"])
        lines += [markdown_table(head, rows), ""]
    lines += [f"Latency: {model['latency']['reason']}.", ""]
    return lines


def _section_recommendations(doc: Mapping[str, Any]) -> list[str]:
    recs = doc["timing"]["recommendations"]
    target = doc["config"].get("target_db")
    lines = ["## Recommendations", ""]
    if not recs:
        lines += ["No recommendation: no latency was measured (see above).", ""]
    else:
        lines += [f"Per variant, the fastest scheme whose SQNR meets {target} dB on each runtime and shape "
                  f"(speedup against {_baseline(doc)} on the same runtime):", ""]
        for rt in sorted({r["runtime"] for r in recs}):
            shapes = sorted({r["tokens"] for r in recs if r["runtime"] == rt})
            rows = []
            for v in _keys(doc):
                cells = []
                for t in shapes:
                    r = next((r for r in recs if (r["runtime"], r["variant"], r["tokens"]) == (rt, v, t)), None)
                    if r is None:
                        cells.append("-")
                        continue
                    sp = f" ({r['speedup']:.1f}x)" if r.get("speedup") not in (None, 1.0) else ""
                    cells.append((r["label"] or "-") + sp + ("" if r["meets_target"] else " (misses target)"))
                rows.append([v] + cells)
            lines += [f"**{rt}**", "", markdown_table(["variant"] + [f"M={t}" for t in shapes], rows), ""]
        primary = doc["timing"]["latency"].get("primary_tokens")
        order = {v: i for i, v in enumerate(_keys(doc))}
        chosen = sorted([r for r in recs if r["tokens"] == primary] or recs,
                        key=lambda r: (order.get(r["variant"], len(order)), r["runtime"], r["tokens"]))
        lines += [f"Why, at M={chosen[0]['tokens']}:", ""]
        lines += [f"- {r['variant']} on {r['runtime']}: {r['reason']}" for r in chosen]
        lines.append("")
    if doc["findings"]:
        lines += ["### Across variants", ""] + [f"- {f['text']}" for f in doc["findings"]] + [""]
    return lines


def _section_ranges(doc: Mapping[str, Any], plots: Mapping[str, bytes]) -> list[str]:
    rng = doc["ranges"]
    lines = ["## Activation ranges per site", ""]
    if rng["status"] == "missing":
        return lines + [f"Not measured: {rng.get('reason')}", ""]
    variants = [v for v in _keys(doc) if v in rng["variants"]]
    sites = [s for s in ("input", "gate_pre", "up", "act", "hidden", "output")
             if any(s in rng["variants"][v]["sites"] for v in variants)]
    rows = []
    for s in sites:
        for v in variants:
            st = rng["variants"][v]["sites"].get(s)
            if st:
                rows.append([s, v, st.get("absmax"), st.get("std"), st.get("crest_factor"), st.get("kurtosis"),
                             st.get("zero_fraction")])
    lines += [markdown_table(["site", "variant", "absmax", "std", "crest (absmax/std)", "kurtosis", "zero fraction"], rows), ""]
    if rng["findings"]:
        lines += ["Findings (from the numbers above):", ""] + [f"- {f}" for f in rng["findings"]] + [""]
    lines += _img(plots, "hidden_hist.png", "histogram of hidden per variant")
    lines += _img(plots, "crest_kurtosis.png", "crest factor and kurtosis per site")
    if rng.get("markdown"):
        lines += ["<details><summary>Full range report</summary>", "", rng["markdown"].strip(), "", "</details>", ""]
    return lines


def _section_claims(doc: Mapping[str, Any]) -> list[str]:
    claims = list(doc["claims"]) + list(doc["timing"]["claims"])
    lines = ["## The seeds' claims, checked", ""]
    if not claims:
        return lines + ["No claim could be checked in this run.", ""]
    rows = [[c["claim"], c["status"].upper() if c["status"] == "contradicted" else c["status"], c["figure"]] for c in claims]
    return lines + [markdown_table(["claim", "verdict", "measured"], rows), ""]


def _section_accuracy(doc: Mapping[str, Any]) -> list[str]:
    acc = doc["accuracy"]
    lines = ["## Accuracy on held-out data", ""]
    if acc["status"] == "missing":
        return lines + [f"Not measured: {acc.get('reason')}", ""]
    lines += ["FFN output against fp32 on the held-out tokens. SQNR = 20 log10(||ref|| / ||ref - q||); "
              "ORT SQNR is the exported artifact run on onnxruntime's CPU provider.", ""]
    rows = []
    for r in acc["rows"]:
        note = "" if r["status"] == "ok" else f"{r['status']}: {r.get('reason') or ''}"
        rows.append([r["variant"], r["label"], _db(r["sqnr_db"]), _db(r.get("onnx_sqnr_db")), r["cosine"],
                     r["max_abs_error"], r["size_bytes"], note])
    lines += [markdown_table(["variant", "scheme", "SQNR dB", "ORT SQNR dB", "cosine", "max abs error",
                              "weight bytes", "note"], rows), ""]
    if acc.get("baseline"):
        b = acc["baseline"]
        lines += [f"onnxruntime's default `quantize_static` (MinMax, per-channel, QDQ) for comparison: {b.get('text', '')}", ""]
    worst = [r for r in acc["rows"] if r.get("sensitivity")]
    if worst:
        lines += ["### Where the error comes from (worst cases)", "",
                  "SQNR (dB) when only one site or weight is quantized as in the scheme; the lowest is the culprit.", ""]
        keys: list[str] = []
        for r in worst:
            keys += [k for k in r["sensitivity"] if k not in keys]
        rows = [[r["variant"], r["label"], _db(r["sqnr_db"])] + [_db(r["sensitivity"].get(k)) for k in keys] for r in worst]
        lines += [markdown_table(["variant", "scheme", "all"] + keys, rows), ""]
    return lines


def _section_latency(doc: Mapping[str, Any], plots: Mapping[str, bytes]) -> list[str]:
    lat = doc["timing"]["latency"]
    lines = ["## Latency", ""]
    rts = [[r["name"], "yes" if r["available"] else "no", r.get("device") or "", r["reason"], r.get("error") or ""]
           for r in lat["runtimes"]]
    if rts:
        lines += [markdown_table(["runtime", "available", "device", "reason", "error during run"], rts), ""]
    if lat["status"] == "missing":
        return lines + [f"Not measured: {lat.get('reason')}", ""]
    errors = [c for c in lat["cases"] if c.get("error")]
    base = _baseline(doc)
    for rt in _runtimes_with_cases(doc):
        cases = [c for c in _ok_cases(doc) if c["runtime"] == rt]
        shapes = sorted({c["tokens"] for c in cases})
        roof = any(c.get("roofline_fraction") is not None for c in cases)
        rows = []
        for v in _keys(doc):
            for s in _scheme_order(doc):
                row_cases = {c["tokens"]: c for c in cases if c["variant"] == v and c["scheme"] == s}
                if not row_cases:
                    continue
                cells = []
                for t in shapes:
                    c = row_cases.get(t)
                    if c is None:
                        cells.append("-")
                        continue
                    cell = _ms(c["median_s"])
                    if c.get("speedup") is not None and s != base:
                        cell += f" ({c['speedup']:.2f}x)"
                    if c.get("slower_than_baseline"):
                        cell += " **slower**"
                    if roof and c.get("roofline_fraction") is not None:
                        cell += f", {100 * c['roofline_fraction']:.0f}% roofline"
                    cells.append(cell)
                rows.append([v, s] + cells)
        lines += [f"### {rt}", "",
                  f"Median ms per call (speedup against {base} on {rt}); **slower** marks a case slower than {base}"
                  + ("; roofline fraction where the device's peak is known." if roof else "; the device's roofline is not known here."),
                  "", markdown_table(["variant", "scheme"] + [f"M={t}" for t in shapes], rows), ""]
        lines += _img(plots, f"scatter_{_slug(rt)}.png", f"accuracy vs latency on {rt}")
        lines += _img(plots, f"latency_tokens_{_slug(rt)}.png", f"latency vs tokens on {rt}")
    if errors:
        lines += ["Cases that failed (recorded, the run went on):", ""]
        lines += [f"- {c['runtime']} {c['variant']} {c['scheme']} M={c['tokens']}: {c['error']}" for c in errors]
        lines.append("")
    return lines


def _section_artifacts(doc: Mapping[str, Any]) -> list[str]:
    arts = doc["artifacts"]
    if not arts:
        return []
    rows = [[a["variant"], a["scheme"], a["path"], a["size_bytes"]] for a in arts]
    return ["## Artifacts", "", markdown_table(["variant", "scheme", "file", "bytes"], rows), ""]


def _section_environment(doc: Mapping[str, Any]) -> list[str]:
    env = doc["environment"]
    rows = [[k, v] for k, v in sorted(env.get("packages", {}).items())]
    lines = ["## Environment", "", f"{env.get('platform')}, Python {env.get('python')}, "
             f"{env.get('torch_threads')} torch threads; onnxruntime providers listed: "
             f"{env.get('onnxruntime_available_providers')}", "", markdown_table(["package", "version"], rows), ""]
    stages = doc["timing"]["stages"]
    if stages:
        lines += ["Time per stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()), ""]
    return lines


def render_markdown(doc: Mapping[str, Any], plots: Mapping[str, bytes]) -> str:
    """The Markdown report; images link to `report_plots/<name>` beside it."""
    lines: list[str] = []
    lines += _section_header(doc)
    lines += _section_recommendations(doc)
    lines += _section_ranges(doc, plots)
    lines += _section_claims(doc)
    lines += _section_accuracy(doc)
    lines += _section_model(doc)
    lines += _section_latency(doc, plots)
    lines += _section_artifacts(doc)
    lines += _section_environment(doc)
    return "\n".join(lines).rstrip() + "\n"


# --- HTML ----------------------------------------------------------------------------------

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1300px;
       padding: 0 1em; color: #1f2328; line-height: 1.45; }
h1 { border-bottom: 2px solid #d0d7de; padding-bottom: .3em; }
h2 { border-bottom: 1px solid #d0d7de; padding-bottom: .2em; margin-top: 2em; }
code { background: #f6f8fa; padding: .1em .3em; border-radius: 4px; font-size: 90%; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
tr:nth-child(even) td { background: #fbfcfd; }
td strong { color: #b42318; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
details { margin: 1em 0; }
"""


def render_html(markdown_text: str, plots: Mapping[str, bytes], title: str = "ffnquant report") -> str:
    """A self-contained HTML page from the Markdown: inline CSS, images as base64 data URIs."""
    # markdown-it-py (a dependency of rich) is a CommonMark-compliant renderer with GFM tables.
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": True}).enable("table")
    body = md.render(markdown_text)

    def embed(match: re.Match) -> str:
        name = match.group(1)
        data = plots.get(name)
        if data is None:
            raise FFNQuantError(f"report HTML refers to plot {name!r} that was not rendered")
        return 'src="data:image/png;base64,' + base64.b64encode(data).decode("ascii") + '"'

    body = re.sub(r'src="' + re.escape(PLOT_DIR) + r'/([^"]+)"', embed, body)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n{body}</body>\n</html>\n"
    )


# --- writing -------------------------------------------------------------------------------

def write_report(doc: Mapping[str, Any], out_dir: str | os.PathLike, stem: str = "report") -> dict[str, Path]:
    """Render everything in memory, then write `<stem>.json/.md/.html` and the plot PNGs atomically.

    Returns the written paths by kind ("json", "md", "html", "plot:<name>").
    """
    # Fail before writing anything: JSON-able without NaN, then plots, Markdown and HTML.
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FFNQuantError(f"report document is not valid JSON: {exc}") from exc
    plots = render_plots(doc)
    md_text = render_markdown(doc, plots)
    html_text = render_html(md_text, plots, title=f"ffnquant report: {doc['command']}")
    out = ensure_writable_dir(out_dir)
    paths: dict[str, Path] = {}
    if plots:
        ensure_writable_dir(out / PLOT_DIR)
    for name, data in plots.items():
        paths[f"plot:{name}"] = write_bytes(out / PLOT_DIR / name, data)
    paths["json"] = write_json(out / f"{stem}.json", doc)
    paths["md"] = write_text(out / f"{stem}.md", md_text)
    paths["html"] = write_text(out / f"{stem}.html", html_text)
    return paths
