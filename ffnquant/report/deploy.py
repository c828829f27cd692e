"""The deployment report: what `export --model --plan --format` wrote, its size against the float folder, and the
proof that it computes what the plan measured."""

from __future__ import annotations

from typing import Any

from ..render import agreement_words, fmt, fmt_bytes, markdown_table, ppl_change

__all__ = ["deploy_markdown", "target_verdict"]


def target_verdict(doc: dict[str, Any]) -> str | None:
    """The plain sentence first: whether the deployed model meets the plan's target, at its 95% confidence bound,
    on the folder loaded back (compressed-tensors) or on ffnquant's reference of the planned model (ONNX). None
    when the plan names no target or nothing was measured."""
    from ..errors import FFNQuantError
    from ..plan.target import Target

    text = (doc.get("plan") or {}).get("target")
    if not text:
        return None
    try:
        target = Target.parse(text)
    except FFNQuantError:
        return None
    proof = doc.get("proof")
    figures, what = ((proof["load"], "the deployed model (loaded back)") if proof and proof.get("load")
                     else (doc.get("reference") or {}, "the deployed model (ffnquant's reference of it)"))
    r = target.resolution(figures)
    if r["point"] is None:
        return None
    shown = r["words"].rsplit(": ", 1)[0]
    if r["met"]:
        verdict = "meets"
    elif not r["resolved"]:
        verdict = "misses (at its 95% confidence bound; the point estimate meets it)"
    else:
        verdict = "misses"
    return f"{what} {verdict} the plan's target ({target.name}): {shown}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * (ratio - 1):+.3f}%"


def _proof_lines(proof: dict[str, Any]) -> list[str]:
    load, weights, inputs, layers = proof["load"], proof["weights"], proof["inputs"], proof["layers"]
    lines = ["## Proof: the folder is the measured model", "",
             f"Verdict: {'PROVEN' if proof['proven'] else 'NOT PROVEN'}", "",
             f"1. Weights: {weights['bit_identical']} of {weights['modules']} FFN weights, decompressed by compressed-tensors "
             "from the files (float ones read as stored), equal ffnquant's dequantized reference bit for bit.",
             f"2. Static input ranges: {inputs['static_inputs']} input scales and zero points in the files "
             f"{'all equal' if inputs['all_equal'] else 'DIFFER from'} the calibrated ones"
             + (f" ({', '.join(inputs['differ'])})" if inputs["differ"] else "") + ".",
             f"3. Layers on the same inputs: {layers['bit_identical']} of {layers['layers']} FFNs of the loaded folder give "
             "ffnquant's output bit for bit; "
             + ("every other one differs by rounding ties only (at least 20 dB below the layer's own quantization "
                "noise: compressed-tensors rounds x/s + z, ffnquant and the int8 kernels round x/s, then add z)."
                if layers["all_at_parity"] else "NOT all within rounding ties."),
             f"4. End to end, loaded with {load['loaded_with']} on {load['n_tokens']} held-out tokens: perplexity "
             f"{fmt(load['baseline_perplexity'])} (float) -> {fmt(load['perplexity'])} ({ppl_change(load)}; "
             f"{agreement_words(load)}), "
             f"final hidden SQNR {fmt(load['hidden_sqnr_db'])} dB; ffnquant's torch reference of the plan on the same "
             f"tokens: {_pct(load['reference_perplexity_ratio'])}, {fmt(load['reference_hidden_sqnr_db'])} dB."]
    if load.get("relative_difference") is not None:
        lines.append(f"   The loaded perplexity differs from the reference by {load['relative_difference']:.2e} relative "
                     f"(bound {load['tolerance']:.0e}: {'met' if load['meets'] else 'not met'}).")
    res = load.get("resolution")
    if res:
        runs = ", ".join(f"{_pct(r['perplexity_ratio'])}" for r in res["runs"])
        lines.append(f"   What float32 rounding alone does to this figure: ffnquant's own quantized model with the "
                     f"scales folded, its first block's input scaled by 1 and 1 +- 2^-23, gives {runs} "
                     f"(up to {res['resolution']:.2e} from the reference). The loaded folder is "
                     f"{'within' if load['within_resolution'] else 'BEYOND'} twice that: static activation codes at a "
                     "rounding boundary flip under any one-ulp change and the later layers' noise is redrawn, so no "
                     "second implementation can match this figure more closely on this text.")
    if load.get("plan_perplexity_ratio") is not None:
        lines.append(f"   The plan's own verification (plan.toml summary): {_pct(load['plan_perplexity_ratio'])}; "
                     f"{fmt(load.get('plan_relative_difference'), 3)} relative to the loaded folder.")
    lines.append("")
    bad = [r for r in weights["rows"] if not r["bit_identical"]]
    if bad:
        lines += [markdown_table(["module", "how", "max |diff|"], [(r["module"], r["how"], r["max_abs_diff"]) for r in bad]),
                  ""]
    lines += [markdown_table(["layer", "bit-identical", "parity SQNR dB", "layer SQNR dB"],
                             [(r["layer"], "yes" if r["bit_identical"] else "no", r["parity_sqnr_db"], r["layer_sqnr_db"])
                              for r in layers["rows"]]), ""]
    return lines


def _graph_lines(graph: dict[str, Any]) -> list[str]:
    lines = ["## The whole model as one ONNX graph", ""]
    if graph.get("status") != "ok":
        return lines + [f"Not written: {graph.get('reason')}", ""]
    lines.append("- files: " + ", ".join(f"{k} ({fmt_bytes(v)})" for k, v in (graph.get("files") or {}).items()))
    score = graph.get("score") or {}
    if score:
        onnx, ref = score.get("graph", score["onnx"]), score["reference"]
        how = " (graph optimizations off: no integer kernel fused in)" if "graph" in score else ""
        lines.append(f"- onnxruntime {graph.get('onnxruntime')} ({', '.join(score.get('providers', []))}){how} on "
                     f"{onnx['n_tokens']} held-out tokens: perplexity {fmt(onnx['perplexity'])} against ffnquant's torch "
                     f"reference {fmt(ref['perplexity'])} ({100 * score['perplexity_rel_diff']:+.3f}%; bound "
                     f"{100 * score['tolerance']:.1f}%: {'met' if score['meets_tolerance'] else 'NOT met'}), final hidden "
                     f"SQNR {fmt(onnx['hidden_sqnr_db'])} dB (reference {fmt(ref['hidden_sqnr_db'])} dB)")
        if "graph" in score:
            ran = score["onnx"]
            lines.append(f"- as it runs here, with onnxruntime's int8 kernels: perplexity {fmt(ran['perplexity'])}, final "
                         f"hidden SQNR {fmt(ran['hidden_sqnr_db'])} dB: {score['int8_kernel']}; exact on CPUs with "
                         f"VNNI and on GPUs")
        res = score.get("resolution")
        if res:
            lines.append(f"- beyond the bound: float32 rounding alone moves ffnquant's own reference of this plan by up to "
                         f"{res['resolution']:.2e} on this text (input scaled by 1 +- 2^-23); the graph is "
                         f"{'within' if score['within_resolution'] else 'BEYOND'} twice that")
    lat = graph.get("latency") or {}
    rows = []
    for n, r in (lat.get("tokens") or {}).items():
        f, q = r["float"], r["quantized"]
        rows.append((n, f"{f['p50_ms']:.2f} ({f['p10_ms']:.2f}-{f['p90_ms']:.2f})",
                     f"{q['p50_ms']:.2f} ({q['p10_ms']:.2f}-{q['p90_ms']:.2f})", f"{r['speedup']:.2f}x"))
    if rows:
        lines += ["", f"Latency on {lat.get('provider')}, batch {lat.get('batch')}, {lat.get('rounds')} interleaved rounds "
                      f"(threads: {lat.get('threads')}):", "",
                  markdown_table(["tokens", "fp32 graph p50 ms (p10-p90)", "quantized graph p50 ms (p10-p90)",
                                  "speedup (p50)"], rows)]
    return lines + [""]


def deploy_markdown(doc: dict[str, Any]) -> str:
    """Markdown of the deployment document `export --model --plan` writes beside the output."""
    m = doc["model"]
    lines = [f"# ffnquant deployment: {m['path']} as {doc['format']}", ""]
    verdict = target_verdict(doc)
    if verdict:  # the plain answer before any proof detail
        lines += [f"**{verdict[0].upper() + verdict[1:]}.**", ""]
    if doc.get("command"):
        lines += [f"Command: `{doc['command']}`", ""]
    env = doc.get("environment", {})
    pk = env.get("packages", {})
    lines += [
        f"- plan: {doc['plan_file']} ({len(doc['plan']['layers'])} layers; target {doc['plan'].get('target')})",
        f"- model: {m['model_type']}, {m['n_layers']} layers, {m['variant']} FFN",
        f"- texts: calibration {doc['texts']['calibration']}; held-out {doc['texts']['evaluation']}",
        f"- machine: {env.get('cpu', '?')} x{env.get('cpu_count', '?')}, "
        f"{'CUDA' if env.get('cuda_available') else 'no GPU'}; torch {pk.get('torch')}, transformers {pk.get('transformers')}, "
        f"compressed-tensors {pk.get('compressed-tensors')}, onnxruntime {pk.get('onnxruntime') or pk.get('onnxruntime-gpu')}",
        f"- weights on disk: {fmt_bytes(doc['sizes']['weights'])} against {fmt_bytes(doc['sizes']['float_weights'])} "
        f"for the float folder ({doc['sizes']['float_weights'] / max(doc['sizes']['weights'], 1):.2f}x smaller)",
        f"- time: {fmt(doc.get('seconds'))} s",
        "",
    ]
    if doc.get("written"):
        w = doc["written"]
        lines += [f"compressed-tensors format: {w['compression_format']}, {w['config_groups']} scheme group(s), "
                  f"{w['quantized_modules']} quantized FFN modules, {len(w['float_ffn_modules'])} FFN modules kept "
                  f"float (in `ignore` with every non-FFN Linear).", ""]
    if doc.get("proof"):
        lines += _proof_lines(doc["proof"])
    if doc.get("graph"):
        lines += _graph_lines(doc["graph"])
    lines += ["## Per layer", ""]
    lines += [markdown_table(["layer", "recipe", "layer SQNR dB (torch)", "file"],
                             [(r["label"], r["recipe"], r["sqnr_db_torch"], r.get("file") or "-") for r in doc["layers"]]),
              ""]
    return "\n".join(lines)
