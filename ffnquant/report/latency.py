"""The latency report's Markdown: a `bench.BenchResult.to_dict()` document with the cross-runtime
numerics table and the GPU targets (pure: returns the text, nothing is measured here)."""

from __future__ import annotations

from typing import Any, Mapping

from ..measure.latency import REFERENCE_TOLERANCE_DB, gpu_targets, numerics_rows
from ..infra.render import fmt_bytes, fmt_db, fmt_ms, markdown_table
from ..spec import FFNSpec

__all__ = ["latency_markdown"]


def _msu(seconds: float | None) -> str:
    return fmt_ms(seconds, unit=True)


def _numerics_markdown(doc: Mapping[str, Any]) -> list[str]:

    rows = numerics_rows(doc)
    if not rows:
        return []
    runtimes = [r["name"] for r in doc["runtimes"] if any(r["name"] in row["runtimes"] for row in rows)]
    table = []
    for row in rows:
        cells = []
        for rt in runtimes:
            got = row["runtimes"].get(rt)
            if got is None:
                cells.append("-")
                continue
            cell = fmt_db(got["sqnr_db"])
            if got.get("sqnr_vs_reference_db") is not None:
                cell += f" / {fmt_db(got['sqnr_vs_reference_db'])}"
            if got.get("disagrees"):
                cell += " **DIFFERS**"
            cells.append(cell)
        table.append([row["variant"], row["scheme"], fmt_db(row["reference_sqnr_db"]), *cells])
    notes = sorted({f"{r['scheme']}: {r['reference_note']}" for r in rows if r.get("reference_note")})
    return ["## Numerics across runtimes", "",
            "The same quantized FFN through every runtime on the same "
            f"{doc['config']['accuracy_tokens']} tokens. `reference`: ffnquant's own fake-quantized model of the scheme "
            "of that name, SQNR against fp32 (fake-quant agreement). Runtime cells: SQNR of the runtime's own output "
            "against fp32 / against that reference (real-kernel agreement; higher is closer). **DIFFERS**: the "
            f"kernel's SQNR is more than {REFERENCE_TOLERANCE_DB} dB from the reference's, i.e. it does not compute "
            "the scheme's numerics (another rounding, symmetry, granularity or activation scaling).", "",
            markdown_table(["variant", "scheme", "reference", *runtimes], table), "",
            "Reference per scheme: " + "; ".join(notes) + ".", ""]


def _targets_markdown(doc: Mapping[str, Any]) -> list[str]:
    targets = gpu_targets(doc)
    if not targets:
        return []
    lines = ["## GPU targets (measured in this run, side by side)", ""]
    for t in targets:
        verdict = {True: "**met**", False: "**not met**", None: "not measured"}[t["met"]]
        if "wall_s" in t:
            lines.append(f"- {t['goal']}: {t['wall_s']:.0f} s, {verdict}")
            continue
        best = t["best"]
        lines.append(f"- {t['goal']}: {verdict}" + (
            f"; best {best['speedup']:.2f}x ({best['runtime']} {best['scheme']}, {_msu(best['median_s'])} against "
            f"{_msu(best['baseline_s'])})" if best else ""))
        for k in sorted(t["kernels"], key=lambda r: -r["speedup"]):
            roof = k.get("roofline_fraction")
            lines.append(f"  - {k['runtime']} {k['scheme']}: {_msu(k['median_s'])}, {k['speedup']:.2f}x"
                         + (f", {100 * roof:.0f}% of the roofline" if roof is not None else ""))
    return lines + [""]


# --- Markdown -----------------------------------------------------------------------------------
def latency_markdown(doc: Mapping[str, Any]) -> str:
    """The Markdown report of a `BenchResult.to_dict()` document (pure: returns the text)."""

    env = doc.get("environment", {})
    pk = env.get("packages", {})
    lines = ["# ffnquant latency", ""]
    if doc.get("command"):
        lines += [f"Command: `{doc['command']}`", ""]
    gpu = env.get("gpu")
    lines += [
        f"- Machine: {env.get('cpu')} ({env.get('cpu_count')} cores, torch threads {env.get('torch_threads')})"
        + (f"; GPU {gpu['name']} (sm {gpu['capability']}, CUDA {gpu['cuda']})" if gpu else "; no GPU"),
        f"- Versions: torch {pk.get('torch')}, triton {pk.get('triton')}, "
        f"onnxruntime {pk.get('onnxruntime-gpu') or pk.get('onnxruntime')}, "
        f"bitsandbytes {pk.get('bitsandbytes')}, onnx {pk.get('onnx')}, numpy {pk.get('numpy')}",
        f"- Budget {doc['config']['budget_s']} s per case after {doc['config']['warmup']} warm-up calls "
        f"(at least {doc['config']['min_repeats']} timed calls); token counts {doc['config']['tokens']}; "
        f"sweep wall time {doc.get('wall_s', 0):.0f} s",
    ]
    if env.get("load_average"):
        la = env["load_average"]
        lines.append(f"- Load average (1/5/15 min) before {la['before']}, after {la['after']}: "
                     "a load above the core count means other processes shared the CPU during the sweep")
    ex = env.get("executor") or {}
    if ex.get("executor") == "ray":
        hosts = sorted({c.get("host") for c in doc["cases"] if c.get("host")})
        lines.append(f"- Ran as Ray tasks ({ex.get('address')}) on {', '.join(hosts)}: each case was timed on its "
                     "host's machine (its device column), not necessarily the one described above")
    for dev, bw in (doc.get("copy_bandwidth_bytes_per_s") or {}).items():
        lines.append(f"- Measured copy bandwidth on {dev}: {bw / 1e9:.3g} GB/s (used for the roofline where no peak is tabled)")
    for dev, p in (doc.get("device_peaks") or {}).items():
        lines.append(f"- Roofline peaks for {p['device']}: {p['memory_bytes_per_s'] / 1e12:.3g} TB/s, "
                     + ", ".join(f"{k} {v / 1e12:.0f} TOPS" for k, v in p["ops_per_s"].items()) + f" ({p['source']})")
    lines += ["", "## Runtimes", ""]
    rows = [[r["name"], "yes" if r["available"] else "no", r["reason"], "; ".join(r.get("ran_with") or []) or "-",
             r.get("error") or "-"] for r in doc["runtimes"]]
    lines += [markdown_table(["runtime", "available", "reason", "what ran", "errors"], rows), ""]
    cases = doc["cases"]
    tokens = doc["config"]["tokens"]
    lines += ["## Median latency per call", "",
              "Cells: median (speedup over the runtime's float baseline; **SLOWER** when its p10 is above the baseline's p90, i.e. slower beyond the measured spread), "
              "then the fraction of the device roofline where known.", ""]
    for rt in [r["name"] for r in doc["runtimes"]]:
        rt_cases = [c for c in cases if c["runtime"] == rt]
        if not rt_cases:
            continue
        base = next((c["baseline"] for c in rt_cases if c.get("baseline")), None)
        lines += [f"### {rt}" + (f" (baseline {base})" if base else ""), ""]
        rows = []
        for spec in doc["specs"]:
            key = FFNSpec.from_dict(spec).key
            for scheme in dict.fromkeys(c["scheme"] for c in rt_cases if c["spec_key"] == key):
                cells = []
                for m in tokens:
                    c = next((c for c in rt_cases if c["spec_key"] == key and c["scheme"] == scheme and c["tokens"] == m), None)
                    if c is None:
                        cells.append("-")
                    elif c["error"]:
                        cells.append("error")
                    else:
                        cell = _msu(c["median_s"])
                        if c.get("speedup") is not None and scheme != c.get("baseline"):
                            cell += f" ({c['speedup']:.2f}x{' **SLOWER**' if c.get('slower_than_baseline') else ''})"
                        if c.get("roofline_fraction") is not None:
                            cell += f", {100 * c['roofline_fraction']:.0f}% roof"
                        if c.get("suspect"):
                            cell += " **SUSPECT**"
                        cells.append(cell)
                first = next(c for c in rt_cases if c["spec_key"] == key and c["scheme"] == scheme)
                sqnr = first.get("sqnr_db")
                rows.append([spec["variant"], scheme, *cells, fmt_bytes(first.get("weight_bytes")),
                             "exact" if sqnr is None and first.get("max_abs_error") == 0 else
                             (f"{sqnr:.1f}" if sqnr is not None else "-")])
        lines += [markdown_table(["variant", "scheme", *[f"M={m}" for m in tokens], "weights", "SQNR dB"], rows), ""]
    if any((c.get("roofline_fraction") or 0) > 1 for c in cases):
        lines += ["Roofline fractions above 100% mean the call beat the bandwidth it is measured against: "
                  "the weights stayed in cache, which the measured DRAM copy bandwidth does not model.", ""]
    suspect = [c for c in cases if c.get("suspect")]
    if suspect:
        lines += ["## Timings not to trust", "",
                  "Marked **SUSPECT** above, and never used for a recommendation: too few samples, or a ratio to the "
                  "baseline that the roofline does not allow (the machine was busy, see the load average).", ""]
        lines += [f"- {c['runtime']} {c['scheme']} ({c['variant']}, M={c['tokens']}): {c['suspect']}" for c in suspect]
        lines.append("")
    lines += _targets_markdown(doc)
    lines += _numerics_markdown(doc)
    errors = [c for c in cases if c["error"]]
    if errors:
        lines += ["## Errors", ""]
        seen = set()
        for c in errors:
            key = (c["runtime"], c["scheme"], c["error"])
            if key not in seen:
                seen.add(key)
                lines.append(f"- {c['runtime']} {c['scheme']} ({c['variant']}): {c['error']}")
        lines.append("")
    if doc.get("skipped"):
        lines += ["## Not run", ""] + [f"- {s['runtime']} {s['scheme']}"
                                       + (f" ({s['variant']})" if s.get("variant") else "") + f": {s['reason']}"
                                       for s in doc["skipped"]] + [""]
    lines += ["Bytes per call count the stored weights (with scales and biases) plus the input and output "
              "activations once; FLOPs are the FFN's nominal count (2 per multiply-add). SQNR is the output "
              f"against fp32 torch on {doc['config']['accuracy_tokens']} random tokens.", ""]
    return "\n".join(lines)
