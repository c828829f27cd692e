"""The run report's Markdown, section by section, from the document (nothing is measured here)."""

from __future__ import annotations

from typing import Any, Mapping

from ..infra.render import fmt, fmt_db, fmt_ms, markdown_table
from .plots import _slug
from .view import _accuracy_index, _baseline, _keys, _ok_cases, _runtimes_with_cases, _scheme_order, _variants

PLOT_DIR = "report_plots"  # beside report.md, so the Markdown's relative image links work

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
    notes = [b["note"] for b in ((model["calibration"].get("tokens") or {}), (model["evaluation"].get("tokens") or {}))
             if b.get("short") and b.get("note")]
    lines[-1:-1] = [f"Note: {n}" for n in notes] + ([""] if notes else [])
    head = ["scheme"] + [layer["label"] for layer in model["layers"]] + ([f"{same} (random weights, d_model "
                                                                          f"{doc['config'].get('d_model')})"] if same else [])
    rows = []
    for s in schemes:
        cells = []
        for k in keys + ([same] if same else []):
            r = acc.get((k, s))
            cells.append("-" if r is None else (fmt_db(r["sqnr_db"]) if r["status"] == "ok" else "skipped"))
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
            rows.append([s["label"], fmt_db(e["hidden_sqnr_db"]), e["hidden_cosine"]]
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
        ort_db = fmt_db(r.get("onnx_sqnr_db"))
        if r.get("onnx_graph_sqnr_db") is not None:  # this CPU's int8 kernel saturates: the graph's own figure beside
            ort_db = f"{ort_db} (graph {fmt_db(r['onnx_graph_sqnr_db'])})"
        rows.append([r["variant"], r["label"], fmt_db(r["sqnr_db"]), ort_db, r["cosine"],
                     r["max_abs_error"], r["size_bytes"], note])
    lines += [markdown_table(["variant", "scheme", "SQNR dB", "ORT SQNR dB", "cosine", "max abs error",
                              "weight bytes", "note"], rows), ""]
    kernel = next((r["int8_kernel"] for r in acc["rows"] if r.get("int8_kernel")), None)
    if kernel:
        lines += [f"ORT SQNR is as it runs here: {kernel}. \"graph\" is the same artifact with graph optimizations off "
                  "(DequantizeLinear then a float MatMul): what it computes on an exact int8 kernel (CPUs with VNNI, GPUs).", ""]
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
        rows = [[r["variant"], r["label"], fmt_db(r["sqnr_db"])] + [fmt_db(r["sensitivity"].get(k)) for k in keys] for r in worst]
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
                    cell = fmt_ms(c["median_s"])
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
