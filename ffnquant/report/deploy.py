"""The deployment report: what `export --model --plan --format` wrote, its size against the float folder, and the
proof that it computes what the plan measured."""

from __future__ import annotations

from typing import Any

from ..errors import FFNQuantError
from ..infra.render import agreement_words, fmt, fmt_bytes, markdown_table, ppl_change
from ..planning.target import Target

__all__ = ["deploy_markdown", "target_verdict", "fold_line", "gate_rows", "decoder_summary", "genai_line"]


def target_verdict(doc: dict[str, Any]) -> str | None:
    """The plain sentence first: whether the deployed model meets the plan's target, at its 95% confidence bound,
    on the folder loaded back (compressed-tensors) or on ffnquant's reference of the planned model (ONNX). None
    when the plan names no target or nothing was measured."""
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


def fold_line(fold: dict[str, Any]) -> str:
    """One sentence: the folded float model against the original, its figure against the float32 bound."""
    if not fold["folded"]:
        return "fold: no layer's recipe puts a scale on the FFN input; nothing folded into the norms"
    figures = ", ".join(f"{name} {fold[key]:.2e}" for name, key in (("logits", "logits_max_rel"),
                                                                      ("final hidden", "hidden_max_rel"))
                        if fold.get(key) is not None)
    n = len(fold["folded"])
    return (f"fold: input scales of {n} layer{'s' if n != 1 else ''} folded into their norms; the folded float model "
            f"against the original: {figures} relative (bound {fold['bound']:.1e}, {fold['bound_why']}): "
            f"{'exact' if fold['exact'] else 'NOT exact'}")


_GATE_NAMES = {"perplexity_ratio": ("perplexity ratio", lambda v: f"{v:.5f}", lambda v: f"{v:.1e} rel"),
               "hidden_sqnr_db": ("final hidden SQNR", lambda v: f"{v:.3f} dB", lambda v: f"{v:.2g} dB"),
               "kl_mean": ("KL mean", lambda v: f"{v:.3g} nats", lambda v: f"{v:.2g} nats")}


def gate_rows(gates: dict[str, Any]) -> list[tuple[str, ...]]:
    """The end-to-end gates as table rows: figure, deployed, reference, how much worse, allowed, met."""
    rows = []
    for g in gates["gates"]:
        name, value, delta = _GATE_NAMES[g["figure"]]
        worse = delta(g["worse_by"]) if g["worse_by"] > 0 or g["figure"] == "perplexity_ratio" else "not worse"
        rows.append((name, value(g["deployed"]), value(g["reference"]), worse, delta(g["allowed"]),
                     "yes" if g["met"] else "NO"))
    return rows


def _fold_lines(fold: dict[str, Any]) -> list[str]:
    lines = ["## The fold, checked on the float model before anything was written", ""]
    if not fold["folded"]:
        return lines + ["No layer's recipe puts a scale on the FFN input: nothing was folded into the norms.", ""]
    norms = sorted({n for v in fold["norms"].values() for n in v})
    lines += [f"SmoothQuant/AWQ input scales of {len(fold['folded'])} layers ({', '.join(fold['folded'])}) went into "
              f"{len(norms)} norm modules. The exported model with float FFN weights (each scale divided out of "
              f"the FFN's input columns, nothing quantized) against the original model on {fold['tokens']} held-out "
              "tokens, max |a - b| / max |a|:", "",
              markdown_table(["compared", "relative difference", "bound", "within"],
                             [(name, f"{fold[key]:.3e}", f"{fold['bound']:.1e}", "yes" if fold[key] <= fold["bound"] else "NO")
                              for name, key in (("logits", "logits_max_rel"), ("final hidden", "hidden_max_rel"))
                              if fold.get(key) is not None]), "",
              f"The bound is float32 rounding, {fold['bound_why']}: the fold is exact in real arithmetic and moves "
              f"one rounding per channel; a correct fold measures 1-3.3 roundoffs per block, a fold into the wrong "
              f"norm 10^5-10^6. Final hidden SQNR of the folded float model: {fmt(fold['hidden_sqnr_db'])} dB.",
              ""]
    return lines


def _gate_lines(load: dict[str, Any]) -> list[str]:
    gates, allowance = load.get("gates"), load.get("allowance")
    if not gates:
        return []
    runs = "; ".join(f"{r['perplexity_ratio']:.6f} / {r['hidden_sqnr_db']:.4f} dB / {r['kl_mean']:.4g}"
                     if r.get("kl_mean") is not None else f"{r['hidden_sqnr_db']:.4f} dB" for r in allowance["runs"])
    dtype, step = allowance.get("compute_dtype", "float32"), _power_of_two(allowance.get("step", 2.0 ** -23))
    if allowance.get("spread_measured", True):
        spread = (f"That spread is measured on the original, unfolded model (computing in {dtype}) with the plan's "
                  f"quantized FFNs, its first block's input scaled by 1 and 1 +- {step} (perplexity ratio / final "
                  f"hidden SQNR / KL mean: {runs}); ")
    else:
        spread = ("The deployed figures met every gate against the reference itself (perplexity ratio / final hidden "
                  f"SQNR / KL mean: {runs}), so no rounding spread was needed and none was measured; ")
    lines = ["", "   Each figure is gated against ffnquant's reference, both measured against the original float model; "
             f"a figure may be worse by twice what {dtype} rounding alone moves the reference. {spread}the "
             "perplexity may also differ by "
             f"{load['tolerance']:.0e} relative, the final hidden state's noise energy and the KL be that much larger "
             "(a deployment's own arithmetic flips static codes at rounding ties).", "",
             markdown_table(["gate", "deployed", "reference", "worse by", "allowed", "met"], gate_rows(gates)), ""]
    if allowance.get("convention"):
        cost = allowance["convention_cost"]
        lines.append(f"   The reference is ffnquant's plan computed with {allowance['convention']}, as the loaded folder "
                     f"runs it (on the same original model); that convention moves ffnquant's own figures by "
                     + ", ".join(f"{_GATE_NAMES[k][0]} {v:+.3g}" for k, v in cost.items()) + ".")
    if allowance.get("deterministic") is False:
        lines.append("   The original model's own forward draws at random (two plain runs on the same text differ by "
                     f"{allowance.get('random_spread')}): ffnquant's recorded reference is one draw, reproduced within "
                     "twice the runs' spread or the load tolerance, and each run at 1 +- one step draws anew, so the "
                     "spread allowed holds the draws.")
    if not gates["reproduces_reference"]:
        lines.append(f"   The allowance's plain run did not reproduce ffnquant's recorded reference "
                     f"({allowance['reference_gap']}): it belongs to another model, so the gates are NOT met.")
    return lines


def _power_of_two(x: float) -> str:
    """2^-23 for 2 ** -23; the number itself when it is no power of two."""
    import math

    k = math.log2(x) if x > 0 else 0.5
    return f"2^{int(k)}" if k == int(k) else f"{x:.3g}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * (ratio - 1):+.3f}%"


def _proof_lines(proof: dict[str, Any]) -> list[str]:
    if proof.get("not_loaded"):  # transformers refused the folder: only the files were checked
        weights = proof["weights"]
        return ["## Proof: the folder is the measured model", "", f"Verdict: NOT PROVEN ({proof['not_loaded']})", "",
                f"1. Weights: {weights['bit_identical']} of {weights['modules']} FFN weights, decompressed by "
                "compressed-tensors from the files, equal ffnquant's dequantized reference bit for bit.",
                "2-5. Not run: the folder does not load.", ""]
    load, weights, inputs, layers = proof["load"], proof["weights"], proof["inputs"], proof["layers"]
    lines = ["## Proof: the folder is the measured model", "",
             f"Verdict: {'PROVEN' if proof['proven'] else 'NOT PROVEN'}"
             + ("" if proof["proven"] or not proof.get("unproven") else f" ({'; '.join(proof['unproven'])})"), "",
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
             f"4. End to end, loaded with {load['loaded_with']} on {load['n_tokens']} held-out tokens, against the "
             f"original float model: perplexity "
             f"{fmt(load['baseline_perplexity'])} (float) -> {fmt(load['perplexity'])} ({ppl_change(load)}; "
             f"{agreement_words(load)}), "
             f"final hidden SQNR {fmt(load['hidden_sqnr_db'])} dB; ffnquant's torch reference of the plan on the same "
             f"tokens: {_pct(load['reference_perplexity_ratio'])}, {fmt(load['reference_hidden_sqnr_db'])} dB."
             + (f" transformers cannot run this model's compressed modules ({load['decompressed_because']}): the folder "
                "was loaded decompressed, as a transformers user must load it (vLLM reads the compressed files "
                "itself)." if load.get("decompressed_because") else "")
             + (f" Its routed experts, which the model holds fused, are stored per expert (as llm-compressor writes "
                f"them) and were read back fused by ffnquant's converters ({len(load['per_expert_loading'])} experts "
                "modules): transformers alone has no conversion for them." if load.get("per_expert_loading") else "")
             + (f" The model's own conversions of tensors the folder stores in float "
                f"({', '.join(f'`{p}`' for p in load['float_converters_kept'][:3])}) were applied as without a "
                "quantization config: transformers alone adds its dequantization to them and fails."
                if load.get("float_converters_kept") else "")
             + (" Load the folder inside `with ffnquant.deploy.transformers_loading(folder):`."
                if load.get("per_expert_loading") or load.get("float_converters_kept") else "")]
    if load.get("relative_difference") is not None:
        lines.append(f"   The loaded perplexity differs from the reference by {load['relative_difference']:.2e} relative "
                     f"(bound {load['tolerance']:.0e}: {'met' if load['meets'] else 'not met'}).")
    lines += _gate_lines(load)
    gen = proof.get("generation")
    if gen and gen.get("skipped"):
        lines.append(f"5. Generation: not compared: {gen['skipped']}.")
    elif gen:
        lines.append(f"5. Generation: greedy with transformers' KV cache, {gen['prompts']} prompts of the held-out text x "
                     f"{gen['new_tokens']} new tokens: the loaded folder's tokens equal ffnquant's reference of the plan "
                     f"(the original model with its quantized FFNs"
                     + (f", under {gen['convention']}" if gen.get("convention") else "")
                     + f") on {gen['equal']} of {gen['prompts']} prompts"
                     + ("." if gen["all_equal"] else "; first differences at token " + ", ".join(
                         str(r["first_difference"]) for r in gen["rows"] if not r["equal"]) + "."))
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


def _experts_node(w: dict[str, Any]) -> str:
    act = w["activation"]
    if act == "swiglu":
        act += f" alpha {w['alpha']:g}, beta {w['beta']:g}" + (f", limit {w['limit']:g}" if w.get("limit") is not None else "")
    if w["op"] == "QMoE":
        grid = f"{w['bits']}-bit " + (f"blocks of {w['block_size']}" if w.get("block_size") else "rows")
        return f"QMoE ({grid}; {act})"
    return f"float MoE ({act})"


def experts_line(experts: dict[str, Any]) -> str | None:
    """The routed experts of a whole-model graph in one line: its onnxruntime MoE/QMoE nodes (None without any)."""
    if not experts:
        return None
    kinds: dict[str, int] = {}
    for w in experts.values():
        kinds[_experts_node(w)] = kinds.get(_experts_node(w), 0) + 1
    nodes = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    return (f"routed experts: one onnxruntime node per experts module, {nodes}, each fed the model's own router "
            "choice; the fp32 graph's are float MoE nodes")


def _graph_lines(graph: dict[str, Any]) -> list[str]:
    lines = ["## The whole model as one ONNX graph", ""]
    if graph.get("status") != "ok":
        return lines + [f"Not written: {graph.get('reason')}", ""]
    lines.append("- files: " + ", ".join(f"{k} ({fmt_bytes(v)})" for k, v in (graph.get("files") or {}).items()))
    experts = experts_line((graph.get("quantize") or {}).get("experts") or {})
    if experts:
        lines.append(f"- {experts}")
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
            lines.append(f"- beyond the bound: float32 rounding alone moves ffnquant's reference of this plan by up to "
                         f"{res['spread']['perplexity_ratio']:.2e} on this text (the original, unfolded model, its input "
                         "scaled by 1 +- 2^-23); the graph is "
                         f"{'within' if score['within_resolution'] else 'BEYOND'} twice that")
    lines += _decoder_lines(graph.get("decoder") or {}, score.get("cached"))
    lat = graph.get("latency") or {}
    rows = []
    for n, r in (lat.get("tokens") or {}).items():
        f, q = r["float"], r["quantized"]
        rows.append((n, f"{f['p50_ms']:.2f} ({f['p10_ms']:.2f}-{f['p90_ms']:.2f})",
                     f"{q['p50_ms']:.2f} ({q['p10_ms']:.2f}-{q['p90_ms']:.2f})", f"{r['speedup']:.2f}x"))
    if rows:
        lines += ["", f"Prefill latency (from an empty cache) on {lat.get('provider')}, batch {lat.get('batch')}, "
                      f"{lat.get('rounds')} interleaved rounds (threads: {lat.get('threads')}):", "",
                  markdown_table(["tokens", "fp32 graph p50 ms (p10-p90)", "quantized graph p50 ms (p10-p90)",
                                  "speedup (p50)"], rows)]
    return lines + [""]


def decoder_summary(decoder: dict[str, Any], cached: dict[str, Any] | None) -> list[str]:
    """The cached decoder in a few terminal lines: generation equality, perplexity through the cache, decode."""
    if not decoder:
        return []
    if decoder.get("status") != "ok":
        return [f"no KV cache (prefill graph): {decoder.get('reason')}"]
    out = []
    gen = decoder.get("generation")
    if gen:
        out.append(f"KV-cache decoder: greedy generation {'equals' if gen['equal'] else 'DIFFERS from'} transformers' "
                   f"on {gen['prompts']} prompts ({gen['tokens_compared']} tokens)")
    genai = decoder.get("genai")
    if genai:
        out.append(genai_line(genai))
    if cached:
        out.append(f"through the cache: perplexity {cached['perplexity']:.4f} ({cached['perplexity_rel_diff_to_once']:+.1e} "
                   f"relative to at once: {'equal' if cached['equals_once'] else 'NOT equal'} within float32 rounding)")
    for n, r in ((decoder.get("decode_latency") or {}).get("contexts") or {}).items():
        out.append(f"decode at {n} tokens of context: fp32 graph {r['float']['p50_ms']:.2f} ms/token, quantized "
                   f"{r['quantized']['p50_ms']:.2f} ms/token (p50; {r['speedup']:.2f}x)")
    return out


def genai_line(genai: dict[str, Any]) -> str:
    """onnxruntime-genai on the quantized decoder in one line: its greedy tokens against ffnquant's loop, or why not."""
    if not genai.get("ran"):
        return f"onnxruntime-genai: not run ({genai.get('reason')})"
    return (f"onnxruntime-genai {genai.get('version')} (`og.Model` + `Generator`, type {genai.get('type')!r}): greedy "
            f"tokens {'equal ffnquant' if genai['equal'] else 'DIFFER from ffnquant'}'s loop on the quantized graph "
            f"({genai['tokens_compared']} tokens, {len(genai['rows'])} prompts)"
            + (f"; {genai['type_note']}" if genai.get("type_note") else ""))


def _decoder_lines(decoder: dict[str, Any], cached: dict[str, Any] | None) -> list[str]:
    """The cached decoder: its layout or why the graph has no cache, greedy generation against transformers',
    the perplexity through the cache and the decode latency table."""
    if not decoder:
        return []
    if decoder.get("status") != "ok":
        return [f"- no KV cache: the graph is the prefill graph (`input_ids` -> `logits`, `last_hidden`); "
                f"{decoder.get('reason')}"]
    lines = [f"- a decoder with a KV cache ({decoder.get('layout')}): one graph for prefill and decode"]
    if decoder.get("attention"):
        lines.append(f"- attention: {decoder['attention']}")
    gen = decoder.get("generation")
    if gen:
        lines.append(f"- greedy generation of the fp32 graph ({gen['provider']}) against transformers' "
                     f"`generate(do_sample=False)`: {gen['prompts']} held-out prompts x {gen['new_tokens']} new tokens "
                     f"(EOS ends one), {gen['tokens_compared']} tokens: "
                     f"{'equal token for token' if gen['equal'] else 'NOT equal'}; the quantized graph's greedy "
                     f"tokens equal the fp32 graph's for the first {', '.join(map(str, gen['quantized_leading_tokens_equal']))}")
    genai = decoder.get("genai")
    if genai:
        lines.append(f"- {genai_line(genai)}; files: {', '.join(genai.get('files') or [])}")
    if cached:
        lines.append(f"- through the cache ({cached['how']}; {cached['provider']}): perplexity {fmt(cached['perplexity'])}, "
                     f"{cached['perplexity_rel_diff_to_once']:+.2e} relative to the same graph at once (logits within "
                     f"{cached['max_abs_logit_diff']:.2g}; float32 rounding bound {cached['logit_tolerance']:.2g}: "
                     f"{'equal' if cached['equals_once'] else 'NOT equal'}), {100 * cached['perplexity_rel_diff']:+.3f}% "
                     f"against the reference ({'met' if cached['meets_tolerance'] else 'NOT met'})")
    lat = decoder.get("decode_latency") or {}
    rows = []
    for n, r in (lat.get("contexts") or {}).items():
        f, q = r["float"], r["quantized"]
        rows.append((n, f"{f['p50_ms']:.2f} ({f['p10_ms']:.2f}-{f['p90_ms']:.2f})",
                     f"{q['p50_ms']:.2f} ({q['p10_ms']:.2f}-{q['p90_ms']:.2f})", f"{r['speedup']:.2f}x",
                     f"{f['tokens_per_s']:.1f} / {q['tokens_per_s']:.1f}"))
    if rows:
        lines += ["", f"Decode latency per token with the cache on {lat.get('provider')} (one new token attending to "
                      f"the context; batch 1, {lat.get('rounds')} interleaved rounds of {lat.get('per_round')}, threads: "
                      f"{lat.get('threads')}):", "",
                  markdown_table(["context tokens", "fp32 graph p50 ms (p10-p90)", "quantized graph p50 ms (p10-p90)",
                                  "speedup (p50)", "tokens/s fp32 / quantized"], rows), ""]
    if lat.get("beyond_max_positions"):
        lines.append(f"- decode latency not measured at {', '.join(map(str, lat['beyond_max_positions']))} tokens: beyond "
                     "the model's max_position_embeddings")
    return lines


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
        *([f"- a draft model, run through its target {doc['target_model']}: each position as the drafting step "
           "after it"] if doc.get("target_model") else []),
        f"- texts: calibration {doc['texts']['calibration']}"
        + ("" if doc["texts"].get("calibration_read", True) else
           " (one sequence, for the range tables: no recipe of this plan reads calibration data)")
        + f"; held-out {doc['texts']['evaluation']}",
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
        fd = w.get("float_dtype") or {}
        if fd.get("compute") and fd["compute"] != "float32":
            lines += [f"Computed in {fd['compute']}, as a runtime serving the {fd['source']} checkpoint computes it: the "
                      f"reference runs the model in {fd['compute']}, each quantized FFN with its scales rounded to "
                      f"{fd['compute']} (codes kept) and compressed-tensors' own input quantizers; every parameter is "
                      f"stored in {fd['stored']} ({fd.get('converted', 0)} exactly, {len(fd.get('rounded') or [])} "
                      f"rounded as the runtime rounds them at load: "
                      f"{', '.join(fd.get('rounded') or []) or 'none'}).", ""]
        elif fd.get("kept_float32"):
            lines += [f"Stored in {fd.get('stored', fd.get('source'))} where lossless ({fd.get('converted', 0)} tensors); "
                      f"kept float32: {', '.join(fd['kept_float32'])}.", ""]
    if doc.get("fold"):
        lines += _fold_lines(doc["fold"])
    if doc.get("proof"):
        lines += _proof_lines(doc["proof"])
    if doc.get("graph"):
        lines += _graph_lines(doc["graph"])
    lines += ["## Per layer", ""]
    lines += [markdown_table(["layer", "recipe", "layer SQNR dB (torch)", "file"],
                             [(r["label"], r["recipe"], r["sqnr_db_torch"], r.get("file") or "-") for r in doc["layers"]]),
              ""]
    return "\n".join(lines)
