"""The `ffnquant model eval` report's Markdown: end to end per recipe, then per layer (pure: returns text)."""

from __future__ import annotations

from typing import Any

from ..infra.render import agreement_words, fmt, markdown_table, ppl_change

__all__ = ["model_eval_markdown", "recipe_name"]


def model_eval_markdown(result: dict[str, Any]) -> str:
    """The Markdown view of an `evaluate_model` result."""
    m = result["model"]
    if "end_to_end_unavailable" in result:
        return _markdown_layers_only(result)
    lines = [f"# FFN quantization of {m['path']}", "",
             f"{m['model_type']} ({m['kind']}): {m['variant']} FFN, activation {m['activation']}, "
             f"d_model {m['spec']['d_model']}, d_ff {m['spec']['d_ff']}, {m['n_layers']} layers, {m['n_ffns']} FFNs.", "",
             f"Calibration text: {result['calibration_text']} ({result['calibration_tokens']} tokens); "
             f"evaluation text: {result['evaluation_text']} ({result['baseline']['n_tokens']} tokens).", ""]
    causal = m["kind"] == "causal_lm"
    if causal:
        lines += [f"Float perplexity: {fmt(result['baseline']['perplexity'])}.", ""]
    head = ["scheme"] + (["perplexity", "Δ ppl", "change (95% CI)", "against float"] if causal else []) + [
        "final hidden SQNR dB", "cosine",
                                                                        "worst layers (own SQNR)", "worst layers (end to end)"]
    rows = []
    for s in result["schemes"]:
        e = s["end_to_end"]
        rows.append([recipe_name(s)] + ([e["perplexity"], e["perplexity_delta"], ppl_change(e), agreement_words(e)]
                                        if causal else [])
                    + [e["hidden_sqnr_db"], e["hidden_cosine"], ", ".join(s["worst_layers_sqnr"]),
                       ", ".join(s["worst_layers_end_to_end"]) or "-"])
    lines += ["## End to end", "", markdown_table(head, rows), ""]
    for s in result["schemes"]:
        ablation = {a["index"]: a for a in s["ablation"]}
        head = ["layer", "module", "SQNR dB", "cosine", "calib tokens"] + (
            ["Δ ppl (this layer alone)"] if causal else ["final hidden SQNR dB (this layer alone)"])
        rows = []
        for r in s["layers"]:
            a = ablation.get(r["index"], {})
            rows.append([r["label"], r["name"], r["sqnr_db"], r["cosine"],
                         f"{r['calib_tokens']}" + (" (borrowed)" if r["calib_borrowed"] else ""),
                         a.get("perplexity_delta") if causal else a.get("hidden_sqnr_db")])
        lines += [f"## {recipe_name(s)}: per layer", "", markdown_table(head, rows), ""]
    for s in result["skipped"]:
        lines.append(f"- skipped {s['scheme']}: {s['reason']}")
    return "\n".join(lines) + "\n"


def _markdown_layers_only(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [f"# FFN quantization of {m['path']} (per layer, captured inputs)", "",
             f"{m['model_type']}: {m['variant']} FFN, d_model {m['spec']['d_model']}, d_ff {m['spec']['d_ff']}. "
             f"Calibration: {result['calibration_captured']}; evaluation: {result['evaluation_captured']}. "
             f"{result['end_to_end_unavailable']}.", ""]
    for s in result["schemes"]:
        rows = [[r["label"], r["name"], r["sqnr_db"], r["cosine"], r["calib_tokens"]] for r in s["layers"]]
        lines += [f"## {recipe_name(s)}", "", markdown_table(["layer", "module", "SQNR dB", "cosine", "calib tokens"], rows), ""]
    for s in result["skipped"]:
        lines.append(f"- skipped {s['scheme']}: {s['reason']}")
    return "\n".join(lines) + "\n"


def recipe_name(entry: dict[str, Any]) -> str:
    """How a result's recipe is shown: its recipe text ('w8a8@mse+smooth'), or the scheme of older results."""
    return entry.get("recipe") or entry["scheme"]
