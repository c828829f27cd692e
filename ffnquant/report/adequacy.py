"""The `ffnquant model adequacy` report's Markdown: does the calibration set suffice (pure: returns text)."""

from __future__ import annotations

from typing import Any, Mapping

from ..infra.render import fmt, fmt_db, markdown_table

__all__ = ["adequacy_markdown", "summary_paragraph"]


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def _rate(value: float | None) -> str:
    """A clip rate: fractions of a percent matter here, so three decimals of a percent."""
    return "-" if value is None else f"{100 * value:.3f}%"


def summary_paragraph(result: Mapping[str, Any]) -> str:
    """One paragraph: how many sites are stable and from how many sequences, which need more data, which clip
    far more on held-out text, and what calibrating on the other domain costs."""
    s = result["summary"]
    parts = []
    if s["n_stable"]:
        parts.append(f"ranges stable from at most {s['stable_from_max']} sequences (median {fmt(s['stable_from_median'])}, "
                     f"of {s['n_sequences']}) in {s['n_stable']} of {s['n_sites']} sites")
    else:
        parts.append(f"no site's range is stable at {s['n_sequences']} sequences ({s['n_sites']} sites)")
    if s["needs_more_data"]:
        by_site = ", ".join(f"{n} {site}" for site, n in (s.get("needs_more_data_by_site") or {}).items() if n)
        parts.append(f"needs more data ({by_site}): " + ", ".join(s["needs_more_data"]) if by_site
                     else "needs more data: " + ", ".join(s["needs_more_data"]))
    if s["held_out_clipping"]:
        parts.append("held-out text clips far more than calibration: " + ", ".join(s["held_out_clipping"]))
    text = "; ".join(parts) + "."
    worst = s.get("largest_shift_loss") or []
    shift = (result.get("texts") or {}).get("shift")
    if worst and shift:
        losses = ", ".join(f"{w['label']} {w['sqnr_delta_db']:+.2f} dB" for w in worst)
        text += (f" Calibrating on {result['texts']['calibration']['source']} instead of {shift['source']} costs "
                 f"at most {losses} of layer output SQNR on the latter.")
    return text


def _spreads(conv: Mapping[str, Any]) -> str:
    return " · ".join(f"{r['n']}: {_pct(r['spread'], 0)}" for r in conv["rows"])


def adequacy_markdown(result: Mapping[str, Any]) -> str:
    """The Markdown view of a `model_adequacy` result (`result['command']`, when set, is shown as how it was made)."""
    m, o, t = result["model"], result["options"], result["texts"]
    cal = t["calibration"]
    lines = [f"# Calibration adequacy of {m['path']}", ""]
    if result.get("command"):
        lines += ["```", result["command"], "```", ""]
    lines += [
        f"{m['model_type']}: {m['variant']} FFN, d_model {m['spec']['d_model']}, d_ff {m['spec']['d_ff']}, "
        f"{m['n_ffns']} FFNs. Scheme {o['scheme']} (static activation ranges), calibrator {o['calibrator']}, "
        f"{o['bins']} histogram bins.", "",
        f"Calibration: {cal['source']}, {fmt((cal['tokens'] or {}).get('obtained'))} tokens in {cal['sequences']} "
        f"sequences of up to {cal['seq_len']} tokens. Held out: {t['evaluation']['source']}, "
        f"{fmt((t['evaluation']['tokens'] or {}).get('obtained'))} tokens. "
        + (f"Shift: {t['shift']['source']}, {fmt(t['shift']['tokens']['obtained'])} tokens." if t.get("shift")
           else "No shift text."), "",
        "## Summary", "", summary_paragraph(result), "",
        "## Method", "",
        f"Each calibration sequence's values per site go into one histogram, once. For n sequences, {o['bootstrap']} "
        f"bootstrap resamples of n sequences (drawn with replacement, seed {o['seed']}) are merged and calibrated "
        f"with {o['calibrator']}; the spread is (p95 - p5) / median of the width between the chosen range's "
        f"clipping limits (what sets the step). A site's ranges are stable from the smallest n from which the spread stays under "
        f"{_pct(o['tolerance'], 0)}; a site still over it with every sequence needs more data. Clip rates count "
        "values outside the range chosen on the whole calibration set (held out: the other text). A remark is "
        f"made when held-out values clip over {o['clip_remark_factor']:g}x as often as calibration values "
        f"(and over {_rate(o['clip_remark_floor'])} more of them). Shift: the range chosen on the shift text itself "
        "against the calibration set's, both measured on the shift text; Δ SQNR is the layer's output SQNR "
        f"under {o['scheme']} with the shift text's ranges minus with the calibration set's.", "",
        "## Per layer and site", "",
    ]
    head = ["layer", "site", "stable from", "spread at all", "spread by n", "clip calib", "clip held-out",
            "held-out absmax beyond", "clip shift (A / B ranges)", "Δ SQNR shift dB", "verdict"]
    rows = []
    for layer in result["layers"]:
        for site, a in layer["sites"].items():
            c, sh = a["convergence"], a["shift"]
            rows.append([
                layer["label"], site,
                f"{c['converged_at']} of {c['n_sequences']}" if c["converged_at"] is not None else f"- of {c['n_sequences']}",
                _pct(c["final_spread"]), _spreads(c), _rate(a["calibration"]["clip_rate"]),
                _rate(a["held_out"]["clip_rate"]), _pct(a["held_out"]["absmax_beyond"]),
                "-" if sh is None else f"{_rate(sh['clip_rate_a'])} / {_rate(sh['clip_rate_b'])}",
                fmt_db(layer["shift_sqnr_delta_db"]) if layer["shift_sqnr_delta_db"] is None
                else f"{layer['shift_sqnr_delta_db']:+.2f}",
                a["verdict"],
            ])
    lines += [markdown_table(head, rows), ""]
    head = ["layer", "held-out SQNR dB", "shift SQNR dB (A ranges)", "shift SQNR dB (B ranges)", "sequences"]
    rows = [[layer["label"], fmt_db(layer["held_out_sqnr_db"]), fmt_db(layer["shift_sqnr_a_db"]),
             fmt_db(layer["shift_sqnr_b_db"]), layer["sequences"]] for layer in result["layers"]]
    lines += [f"## Layer output SQNR under {o['scheme']}", "", markdown_table(head, rows), ""]
    sec = result.get("seconds") or {}
    if sec:
        cpu = (f"; CPU time {sec['cpu_total']:.0f} s: {sec['cpu_load_and_capture']:.0f} s and "
               f"{sec['cpu_measure']:.0f} s" if "cpu_total" in sec else "")
        lines += [f"Wall time {sec['total']:.0f} s (loading the model and capturing its inputs on the texts "
                  f"{sec['load_and_capture']:.0f} s, measuring {sec['measure']:.0f} s{cpu}).", ""]
    return "\n".join(lines)
