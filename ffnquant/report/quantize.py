"""The `ffnquant quantize` report's Markdown: one FFN under one recipe, or a real model's layers
(per layer, then end to end). Pure: returns the text of a result document."""

from __future__ import annotations

from ..infra.render import agreement_words, fmt, markdown_table, ppl_change

__all__ = ["quantize_markdown", "quantize_model_markdown"]


def quantize_markdown(data: dict) -> str:
    """The Markdown summary of one `QuantResult.to_dict()`."""
    spec, scheme = data["spec"], data["scheme"]
    lines = [
        f"# ffnquant quantize: {spec['variant']} d={spec['d_model']} d_ff={spec['d_ff']}, scheme {scheme['name']}",
        "",
        f"- data: {data['source']}; {data['n_calib_tokens']} calibration tokens, {data['n_eval_tokens']} held-out evaluation tokens",
        f"- calibrator: {data['calibrator'] or '-'}; remedies: "
        + (", ".join(f"{r['kind']} {r['params']}" + (f" ({r['note']})" if r["note"] else "") for r in data["remedies"]) or "none"),
        "",
        "## Accuracy against fp32 (held-out tokens)",
        "",
    ]
    rows = [("torch reference", *[data["accuracy_torch"][k] for k in ("sqnr_db", "cosine", "rel_l2", "max_abs_error")], None, None)]
    art = data.get("artifact") or {}
    if art.get("accuracy_onnx"):
        a = art["accuracy_onnx"]
        rows.append((f"ONNX artifact ({art['kind']})", a["sqnr_db"], a["cosine"], a["rel_l2"], a["max_abs_error"], art.get("size_bytes"), art.get("latency_ms")))
    base = data.get("ort_default_baseline") or {}
    if base.get("accuracy_onnx"):
        a = base["accuracy_onnx"]
        rows.append(("ORT default quantize_static", a["sqnr_db"], a["cosine"], a["rel_l2"], a["max_abs_error"], base.get("size_bytes"), base.get("latency_ms")))
    fp32 = data.get("fp32") or {}
    if fp32:
        rows.append(("fp32 ONNX", None, None, None, None, fp32.get("size_bytes"), fp32.get("latency_ms")))
    lines.append(markdown_table(["model", "SQNR dB", "cosine", "rel L2", "max abs err", "bytes", "ORT CPU ms"], rows))
    if art and not art.get("accuracy_onnx"):
        lines += ["", f"No ONNX artifact: {art.get('note')}."]
    if data["ranges"]:
        lines += ["", "## Activation ranges per site", ""]
        lines.append(markdown_table(
            ["site", "calibrator", "lo", "hi", "observed min", "observed max", "scale", "zero point"],
            [(s, r["calibrator"], r["lo"], r["hi"], r["observed_min"], r["observed_max"], r["scale"], r["zero_point"]) for s, r in data["ranges"].items()],
        ))
    if data["sensitivity_sqnr_db"]:
        lines += ["", "## Where the error comes from (SQNR with only this one quantized)", ""]
        lines.append(markdown_table(["quantized alone", "SQNR dB"], sorted(data["sensitivity_sqnr_db"].items(), key=lambda kv: kv[1])))
    env = data["environment"]
    lines += ["", f"_{env.get('timestamp_utc')} on {env.get('cpu')}, torch {env['packages'].get('torch')}, onnxruntime {env['packages'].get('onnxruntime-gpu') or env['packages'].get('onnxruntime')}_", ""]
    return "\n".join(lines)


def quantize_model_markdown(data: dict) -> str:
    """The Markdown summary of `hf.quantize_model_layers` (one row per FFN layer, then end to end)."""
    m, scheme = data["model"], data["scheme"]
    spec = m["spec"]
    remedies = ", ".join(f"{r['kind']} {r['params']}" + (f" ({r['note']})" if r["note"] else "") for r in data["remedies"])
    calib = data["calibration"]["tokens_per_layer"].values()
    evals = data["evaluation"]["tokens_per_layer"].values()
    lines = [
        f"# ffnquant quantize: {m['path']}, scheme {scheme['name']}",
        "",
        f"- model: {m['model_type']} ({m['kind']}), {m['variant']} FFN (activation {m['activation']}), d_model {spec['d_model']}, "
        f"d_ff {spec['d_ff']}, {len(data['layers'])} of {m['n_ffns']} FFN layers quantized",
        f"- calibration: {data['calibration']['source']}, {min(calib)}-{max(calib)} tokens per layer",
        f"- held-out evaluation: {data['evaluation']['source']}, {min(evals)}-{max(evals)} tokens per layer "
        f"({data['evaluation']['separation']})",
        f"- calibrator: {data['calibrator'] or '-'}; remedies: {remedies or 'none'}",
        "",
        "## Per layer: FFN output against fp32 on held-out inputs",
        "",
    ]
    rows = []
    for r in data["layers"]:
        acc, art = r["accuracy_torch"], r.get("artifact") or {}
        base = (r.get("ort_default_baseline") or {}).get("accuracy_onnx") or {}
        sens = r.get("sensitivity_sqnr_db") or {}
        worst = min(sens.items(), key=lambda kv: kv[1]) if sens else None
        rows.append((r["label"] + (f" ({r['recipe']})" if "plan" in data else ""), r["name"], acc["sqnr_db"], (art.get("accuracy_onnx") or {}).get("sqnr_db"),
                     base.get("sqnr_db"), acc["cosine"], acc["max_abs_error"],
                     f"{worst[0]} ({fmt(worst[1])} dB)" if worst else "-", art.get("size_bytes")))
    lines.append(markdown_table(["layer", "module", "SQNR dB", "ONNX SQNR dB", "ORT default SQNR dB", "cosine",
                                 "max abs err", "worst alone (sensitivity)", "artifact bytes"], rows))
    secs = [r["seconds"] for r in data["layers"] if r.get("seconds") is not None]
    lines += ["", f"Lowest SQNR: {', '.join(data['worst_layers_sqnr'])}.", ""]
    if secs:
        lines += [f"Time per layer (calibrate, quantize, export, score): {sum(secs) / len(secs):.2f} s on average, "
                  f"{min(secs):.2f}-{max(secs):.2f} s; {sum(secs):.1f} s for {len(secs)} layers.", ""]
    e2e = data["end_to_end"]
    lines += ["## End to end", ""]
    if e2e["status"] != "ok":
        lines += [f"Not measured: {e2e['reason']}.", ""]
    else:
        e, base = e2e["end_to_end"], e2e["baseline"]
        causal = "perplexity" in e
        text = (f"Every selected FFN quantized and put back into the model, on {base['n_tokens']} tokens of "
                f"{e2e['evaluation_text']}: final hidden state SQNR {fmt(e['hidden_sqnr_db'])} dB, cosine {fmt(e['hidden_cosine'])}")
        if causal:
            text += (f"; perplexity {fmt(base['perplexity'])} -> {fmt(e['perplexity'])}, {ppl_change(e)}; "
                     f"{agreement_words(e)}")
        lines += [text + ".", ""]
        if e2e["ablation"]:
            head = ["layer quantized alone", "final hidden SQNR dB", "cosine"] + (["Δ perplexity"] if causal else [])
            arows = [[a["label"], a["hidden_sqnr_db"], a["hidden_cosine"]] + ([a["perplexity_delta"]] if causal else [])
                     for a in e2e["ablation"]]
            lines += [markdown_table(head, arows), "", f"Hurts most end to end: {', '.join(e2e['worst_layers_end_to_end'])}.", ""]
    arts = [(r["label"], (r.get("artifact") or {}).get("path")) for r in data["layers"] if (r.get("artifact") or {}).get("path")]
    if arts:
        lines += ["## Artifacts", "", markdown_table(["layer", "file"], arts), ""]
    env = data["environment"]
    lines += [f"_{env.get('timestamp_utc')} on {env.get('cpu')}, torch {env['packages'].get('torch')}, "
              f"transformers {env['packages'].get('transformers', '-')}_", ""]
    return "\n".join(lines)
