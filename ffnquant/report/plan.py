"""The plan report: what was chosen per layer, the costs against single recipes, and the verification."""

from __future__ import annotations

from typing import Any

from ..planning.floor import FLOOR_CLEARANCE_DB
from ..planning.job import final_round
from ..planning.steering import AIM, MIN_GAIN
from ..infra.render import agreement_words, fmt, fmt_bytes, markdown_table
from ..infra.resources import human_bytes

__all__ = ["plan_markdown", "domain_lines"]


def domain_lines(final: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """One line per held-out domain of a verification round: the target's verdict at its confidence bound, then
    perplexity, KL divergence and top-1 agreement against the float model."""
    out = []
    for label, fig in (final.get("domains") or {}).items():
        base = ((baseline.get("domains") or {}).get(label) or {}).get("perplexity")
        res = fig.get("resolution") or {}
        out.append(f"{label}: {res.get('words', '-')}; perplexity {fmt(base)} -> {fmt(fig.get('perplexity'))}, "
                   f"{agreement_words(fig)}, {fig.get('n_predicted') or 0:,} tokens")
    return out


def _cost(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} ms" if unit == "ms" else fmt_bytes(int(value))


def plan_markdown(data: dict[str, Any], command: str | None = None) -> str:
    """Markdown of `planning.job.make_plan`'s result."""
    m, plan = data["model"], data["plan"]
    unit = plan["summary"]["objective_unit"]
    final = final_round(data)
    e, base = final["end_to_end"], data["baseline"]
    lines = [f"# ffnquant plan: {m['path']} for {data['target']}, least {data['objective']}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    verdict = "meets" if data["verified"] else "MISSES"
    lines += [
        f"- model: {m['model_type']}, {m['n_layers']} layers, {m['variant']} FFN, d_model {m['spec']['d_model']}, "
        f"d_ff {m['spec']['d_ff']}",
        *([f"- a draft model, run through its target {data['target_model']}: each position as the drafting step "
           "after it"] if data.get("target_model") else []),
        f"- search text (calibration, candidates, probes): {data['calibration']}; held-out text (verification): "
        f"{data['evaluation']}",
        f"- verified on {len(final.get('domains') or {}) or 1} held-out text(s), each at its 95% confidence bound: "
        f"{verdict} {data['target']} after {len(data['rounds'])} round(s); worst: {final.get('worst_domain', '-')}, "
        f"final hidden SQNR {fmt(e.get('hidden_sqnr_db'))} dB",
        *[f"  - {line}" for line in domain_lines(final, base)],
        *([f"- verification computed in {data['verified_in']}, the dtype the deployed model computes in (the float "
           f"figures too: the float model in {data['verified_in']}); candidates scored in float32"]
          if data.get("verified_in") not in (None, "float32") else []),
        f"- FFN stack cost: {_cost(final['cost'], unit)} against {_cost(data['fp32_cost'], unit)} for fp32 "
        f"({data['fp32_cost'] / final['cost']:.2f}x)" if final["cost"] else "- FFN stack cost: -",
        f"- search: {data['search']}; time {fmt(data['timings']['total_s'])} s",
        f"- model run: {'a decoder layer at a time' if data.get('streamed') else 'the whole model in memory'}"
        + (f" ({data['memory']['reason']}; estimated peak {human_bytes(data['memory']['peak'])})"
           if data.get("memory") else ""),
        "",
        "## Per layer",
        "",
    ]
    rows = []
    for idx, layer in data["layers"].items():
        chosen = final["layers"][idx] if idx in final["layers"] else final["layers"].get(str(idx))
        row = next(r for r in layer["candidates"] if r["recipe"] == chosen)
        damage = row["predicted_hidden_nsr"] if data["target"].startswith("sqnr") else row["predicted_kl"]
        ort = layer.get("ort_best") or {}
        rows.append((layer["label"], chosen, row["layer_sqnr_db"],
                     f"{fmt(ort.get('sqnr_db'))} ({ort['method']})" if ort else
                     ("cleared" if layer.get("ort_cleared") else "-"), damage,
                     _cost(row.get("latency_ms"), "ms"), fmt_bytes(row["bytes"]),
                     " > ".join(data["pareto_per_layer"][idx][:4])))
    what = "predicted final NSR" if data["target"].startswith("sqnr") else "predicted KL (nats/token)"
    lines += [markdown_table(["layer", "recipe", "layer SQNR dB (held-out)", "onnxruntime's best dB", what, "latency",
                              "bytes", "cheapest non-dominated candidates"], rows), "",
              "onnxruntime's best: the best of its quantize_static (MinMax, Percentile; Entropy at its defaults writes "
              "MinMax's model, so it is not run again) and quantize_dynamic "
              "on the same calibration and held-out inputs, measured on the layers where the search picked a static int8 "
              "candidate ('-' elsewhere: no static int8 candidate was in question there; 'cleared': the one picked "
              f"clears the layer's plain static int8 calibration, which onnxruntime's quantizers compute on the same "
              f"grid, by {FLOOR_CLEARANCE_DB:g} dB or more, so the floor was not measured); static int8 candidates below "
              "it on a layer were left out and the search solved again.", ""]
    if data.get("not_scored"):
        lines += ["Candidates not scored, since the objective can never choose them (the plan is the same without "
                  "them):", ""] + [f"- {recipe}: {why}" for recipe, why in data["not_scored"].items()] + [""]
    if data.get("probes_unscored"):
        lines += [f"Probes only quantized, for their ablations (no solution can choose them; the prediction's fit reads "
                  f"their FFN on the probe tokens, not their scores): {', '.join(data['probes_unscored'])}.", ""]
    if data.get("deferred_skipped"):
        lines += [f"Candidates whose calibration reads second-order statistics ({', '.join(data['deferred'])}) were "
                  f"{data['deferred_skipped']}: the plan is the one without them.", ""]
    elif data.get("deferred"):
        n = len(data["layers"])
        bounds = data.get("deferred_bounds") or {}
        how = ("entered the search at their cost and a damage bound learned on this model: half the least ratio of "
               "their scored damage to round to nearest's on the same layer, times round to nearest's damage there "
               "(at most the median layer's); the plan is the one scoring them everywhere gives wherever no layer's "
               "ratio is below that bound" if bounds else
               "entered the search at their cost and no damage, so the plan is the one scoring them everywhere gives")
        lines += [f"Candidates scored only on the layers where a solution picked one (their calibration reads "
                  f"second-order statistics). Unscored, they {how}:", ""] + [
            f"- {recipe}: scored on {len(idx)} of {n} layers"
            + (f"; least ratio {bounds[recipe]['least_ratio']:.2f} on {bounds[recipe]['layers']} layers"
               if recipe in bounds else "") for recipe, idx in data["deferred"].items()] + [""]
    if data.get("atlas"):
        lines += [f"The layer atlas with the plan drawn over it: [{data['atlas']}]({data['atlas']}) "
                  "(crest factor, kurtosis and outlier channels per layer and site, and the recipe each site got).", ""]
    lines += ["## Verification rounds", "",
              "Each round solves the search within a damage budget, quantizes every layer as chosen, puts them all "
              "back into the model and measures on the held-out text; the plan is the cheapest round that met the "
              "target there.", ""]
    lines.append(markdown_table(
        ["round", "damage budget (x target)", "predicted", "measured (worst held-out)", "its bound",
         "worst held-out text", "its verdict", "cost", "met on all"],
        [(r["round"] if r["round"] != data["final_round"] else f"**{r['round']}** (the plan)", r["safety"], r["predicted"],
          r["measured"], r.get("measured_bound"), r.get("worst_domain", "-"),
          ((r.get("domains") or {}).get(r.get("worst_domain")) or {}).get("resolution", {}).get("words", "-"),
          _cost(r["cost"], unit), "yes" if r["met"] else "no")
         for r in data["rounds"]]))
    steer = data.get("steering") or {}
    w = steer.get("noise_per_kl")
    lines += ["", "Predicted, measured and bound are in the target's budget units (nats per token of mean NLL for a "
              "ppl target, mean KL nats for kld, KL-equivalent nats (top-1 disagreement / 0.4)^2 for top1, final "
              "hidden noise-to-signal ratio for an SQNR target), on the worst held-out text; the bound is the "
              "unfavourable end of its 95% confidence interval (paired per-sequence differences against the float "
              "model). A round meets the target only when every held-out text meets it at that bound. The next "
              "round's budget is the largest predicted damage whose bound, by a model fitted on the rounds so far "
              "(measured = a x predicted, bound - measured = c x sqrt(predicted), per text), stays within "
              f"{100 * steer.get('aim', AIM):.0f}% of the target; a round is run only if its plan would cost at "
              f"least {100 * steer.get('min_gain', MIN_GAIN):.1f}% less than the cheapest one that met (1%, or the "
              "latency table's resolution when coarser: the relative standard error of its recipes' median times). "
              "The first "
              "round's interval width comes from the probes' ablations"
              + (f" (the NLL change of a probe sequence scatters about its KL with variance {w:.3g} x KL)." if w else "."),
              ""]
    lines += ["", "## Against one recipe on every layer (same measured table)", ""]
    lines.append(markdown_table(["recipe", "FFN stack cost", "vs plan", "predicted damage"],
                                [(s["recipe"], _cost(s["cost"], unit), f"{s['cost'] / final['cost']:.2f}x" if final["cost"] else "-",
                                  s["predicted"]) for s in sorted(data["single_recipes"], key=lambda s: s["cost"])]))
    if data.get("latency_table"):
        table = data["latency_table"]
        if any("runtime" in v for v in table.values()):  # timed on torch-module runtimes, each on its kernel
            lines += ["", f"## Latency table (one FFN at the model's shape, {data['plan']['objective']})", ""]
            lines.append(markdown_table(
                ["recipe", "request p10 ms", "request p50 ms", "request p90 ms", "prefill p50 ms", "decode step p50 ms",
                 "runtime", "kernel", "note"],
                [(k, v.get("p10_ms"), v.get("p50_ms"), v.get("p90_ms"), v.get("prefill_ms"), v.get("decode_ms"),
                  v.get("runtime", "-"), v.get("kernel", "-"), v.get("reason") or v.get("note", ""))
                 for k, v in table.items()]))
        else:
            lines += ["", f"## Latency table (one FFN at the model's shape, onnxruntime CPU, {data['plan']['objective']})",
                      ""]
            lines.append(markdown_table(
                ["recipe", "request p10 ms", "request p50 ms", "request p90 ms", "prefill p50 ms", "decode step p50 ms",
                 "artifact", "ONNX SQNR dB", "note"],
                [(k, v.get("p10_ms"), v.get("p50_ms"), v.get("p90_ms"), v.get("prefill_ms"), v.get("decode_ms"),
                  v.get("kind", "-"), v.get("onnx_sqnr_db"),
                  v.get("reason") or (f"the same graph as {v['timed_as']}: timed once" if v.get("timed_as") else ""))
                 for k, v in table.items()]))
    fit = data["probe_fit"]
    if fit:
        lines += ["", "## How good the prediction is: probes measured against predicted", "",
                  f"Per layer the probes ({', '.join(data['probes'])}) were measured alone on {data['probe_tokens']} "
                  "search tokens (that layer quantized, the rest float); the per-layer factor is fitted on them, "
                  "so these rows show the fit's residual. Every other candidate's damage is predicted.", ""]
        lines.append(markdown_table(["layer", "probe", "measured KL", "predicted KL", "measured Δ NLL", "final hidden NSR"],
                                    [(r["layer"], r["recipe"], r["kl"], r["predicted_kl"], r["nll_delta"], r["hidden_nsr"])
                                     for r in fit]))
    folds = data.get("fold_refusals") or {}
    if folds:
        lines += ["", "## Layers whose input scale cannot fold (SmoothQuant and AWQ not chosen there)", ""]
        lines.append(markdown_table(["layer", "why (from the model's graph)"], [(f"L{i}", why) for i, why in folds.items()]))
    refused = {fmt_: why for fmt_, why in (data.get("deployment") or {}).items() if why}
    if refused:
        lines += ["", "Export of this architecture: " + "; ".join(f"{f} refused ({why})" for f, why in refused.items())]
    if data["skipped_candidates"]:
        lines += ["", "Candidates left out: " + "; ".join(f"{s['recipe']} ({s['reason']})" for s in data["skipped_candidates"])]
    t = data["timings"]
    lines += ["", "Time: " + ", ".join(f"{k.removesuffix('_s')} {fmt(v)} s" for k, v in t.items()), ""]
    env = data.get("environment") or {}
    if env:
        lines += [f"_{env.get('timestamp_utc')} on {env.get('cpu')}, torch {env['packages'].get('torch')}, "
                  f"onnxruntime {env['packages'].get('onnxruntime') or env['packages'].get('onnxruntime-gpu', '-')}_", ""]
    return "\n".join(lines)
