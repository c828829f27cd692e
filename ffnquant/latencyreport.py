"""The latency report: per-call statistics of timed samples, device peaks and the roofline, and
Markdown of a `bench.BenchResult.to_dict()` document with the cross-runtime numerics table and
the GPU targets; all pure functions of numbers (nothing here measures).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import FFNQuantError
from .spec import FFNSpec

__all__ = [
    "LatencyStats",
    "latency_stats",
    "DevicePeaks",
    "DEVICE_PEAKS",
    "device_peaks",
    "roofline",
    "REFERENCE_TOLERANCE_DB",
    "numerics_rows",
    "gpu_targets",
    "latency_markdown",
]

# A runtime's kernel "disagrees" with ffnquant's reference of the same scheme when their SQNRs
# against fp32 differ by more than this: the 0.5 dB that ffnquant's ONNX artifacts are held to.
REFERENCE_TOLERANCE_DB = 0.5


# --- statistics ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LatencyStats:
    """Per-call latency in seconds over `n` timed calls."""

    n: int
    median_s: float
    p10_s: float
    p90_s: float
    p99_s: float
    mean_s: float
    std_s: float
    min_s: float
    max_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def latency_stats(samples: Sequence[float]) -> LatencyStats:
    """Statistics of per-call times: percentiles by linear interpolation (numpy's default), sample std."""
    arr = np.asarray(samples, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise FFNQuantError("latency statistics need at least one sample")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise FFNQuantError("latency samples must be finite and non-negative")
    p10, p50, p90, p99 = np.percentile(arr, [10, 50, 90, 99])
    std = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
    return LatencyStats(
        n=int(arr.size),
        median_s=float(p50),
        p10_s=float(p10),
        p90_s=float(p90),
        p99_s=float(p99),
        mean_s=float(arr.mean()),
        std_s=std,
        min_s=float(arr.min()),
        max_s=float(arr.max()),
    )


# --- device peaks and the roofline ----------------------------------------------------------
@dataclass(frozen=True)
class DevicePeaks:
    """Spec-sheet peaks of one device: memory bandwidth (bytes/s) and dense ops/s per compute type."""

    name: str
    match: str  # case-insensitive substring of the device name
    memory_bytes_per_s: float
    ops_per_s: Mapping[str, float]
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory_bytes_per_s": self.memory_bytes_per_s,
            "ops_per_s": dict(self.ops_per_s),
            "source": self.source,
        }


# Dense (no sparsity) peaks from NVIDIA's data sheets; fp32 is the non-tensor-core rate,
# since torch leaves TF32 off for fp32 matmuls by default. Order matters: the first match wins.
DEVICE_PEAKS: tuple[DevicePeaks, ...] = (
    DevicePeaks("H200", "h200", 4.8e12, {"fp32": 67e12, "fp16": 989e12, "fp8": 1979e12, "int8": 1979e12},
                "NVIDIA H200 SXM data sheet (HBM3e 4.8 TB/s)"),
    DevicePeaks("H100 PCIe", "h100 pcie", 2.0e12, {"fp32": 51e12, "fp16": 756e12, "fp8": 1513e12, "int8": 1513e12},
                "NVIDIA H100 PCIe data sheet"),
    DevicePeaks("H100 SXM", "h100", 3.35e12, {"fp32": 67e12, "fp16": 989e12, "fp8": 1979e12, "int8": 1979e12},
                "NVIDIA H100 SXM data sheet"),
    DevicePeaks("A100 80GB", "a100", 2.039e12, {"fp32": 19.5e12, "fp16": 312e12, "int8": 624e12},
                "NVIDIA A100 SXM 80GB data sheet"),
)


def device_peaks(device_name: str | None) -> DevicePeaks | None:
    """The peaks entry whose `match` occurs in `device_name` (None: unknown device, e.g. a CPU)."""
    if not device_name:
        return None
    lowered = device_name.lower()
    return next((p for p in DEVICE_PEAKS if p.match in lowered), None)


def roofline(
    bytes_moved: float,
    flops: float,
    seconds: float,
    compute: str,
    peaks: DevicePeaks | None,
    copy_bandwidth: float | None = None,
) -> tuple[float | None, str | None]:
    """(fraction of the attainable time, what bounds it) for one call; (None, None) if nothing is known.

    Attainable time is max(bytes / bandwidth, flops / peak ops) (Williams et al.'s roofline);
    the fraction is attainable / measured, so 1.0 means running at the device's limit.
    Spec-sheet bandwidth is used where the device is in the table, else a measured copy bandwidth.
    """
    bandwidth = peaks.memory_bytes_per_s if peaks is not None else copy_bandwidth
    peak_ops = peaks.ops_per_s.get(compute) if peaks is not None else None
    t_mem = bytes_moved / bandwidth if bandwidth else None
    t_ops = flops / peak_ops if peak_ops else None
    if seconds <= 0 or (t_mem is None and t_ops is None):
        return None, None
    if t_ops is None:
        return t_mem / seconds, "memory (compute peak unknown)"
    if t_mem is None:
        return t_ops / seconds, "compute (bandwidth unknown)"
    return max(t_mem, t_ops) / seconds, ("memory" if t_mem >= t_ops else "compute")


# --- derived tables (pure functions of a BenchResult.to_dict() document) ----------------------------
def numerics_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The cross-runtime numerics table: per (variant, scheme), ffnquant's reference and every runtime's output.

    Each row: variant, scheme, reference_sqnr_db, reference_note and `runtimes`, a dict runtime ->
    {sqnr_db (against fp32), sqnr_vs_reference_db, disagrees}: fake-quant agreement (the reference
    against fp32) and real-kernel agreement (each kernel against the reference) side by side.
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for c in doc.get("cases", []):
        if c.get("error") or c.get("sqnr_db") is None and c.get("max_abs_error") is None:
            continue
        key = (c["spec_key"], c["scheme"])
        row = rows.setdefault(key, {"variant": c["variant"], "spec_key": c["spec_key"], "scheme": c["scheme"],
                                    "reference_sqnr_db": c.get("reference_sqnr_db"),
                                    "reference_note": c.get("reference_note"), "runtimes": {}})
        exact = c.get("sqnr_db") is None and c.get("max_abs_error") == 0  # infinite SQNR is stored as None
        row["runtimes"].setdefault(c["runtime"], {"sqnr_db": math.inf if exact else c.get("sqnr_db"),
                                                  "sqnr_vs_reference_db": c.get("sqnr_vs_reference_db"),
                                                  "disagrees": c.get("disagrees_with_reference")})
    return list(rows.values())


# The GPU targets, checked on the figures of the run itself.
W4A16_DECODE_TARGET = 3.5  # x over fp16 at M = 1, SwiGLU d_model 4096 (4-bit weights: ideal about 3.9x)
INT8_FP8_PREFILL_TARGET = 1.5  # x over bf16 at M = 2048
GPU_RUN_TARGET_S = 360.0


def _median(cases: Sequence[Mapping[str, Any]], **keys: Any) -> float | None:
    c = next((c for c in cases if all(c.get(k) == v for k, v in keys.items()) and not c.get("error")), None)
    return None if c is None else c.get("median_s")


def gpu_targets(doc: Mapping[str, Any], variant: str = "swiglu") -> list[dict[str, Any]]:
    """The GPU targets measured in this run: each kernel's speedup over its own runtime's float case.

    W4A16 at one token against fp16, W8A8/FP8 at the largest token count against bf16, both on the
    same runtime (eager, graph or compile) so that launch overhead is counted alike; and the run's
    wall time. Empty when no CUDA case ran.
    """
    cases = [c for c in doc.get("cases", []) if c.get("variant") == variant and "cuda" in c.get("runtime", "")
             and not c.get("error")]
    if not cases:
        return []
    out: list[dict[str, Any]] = []
    big = max(doc["config"]["tokens"])

    def add(goal: str, target: float, scheme_ok, base_scheme: str, m: int) -> None:
        rows = []
        for c in cases:
            if c["tokens"] != m or not scheme_ok(c["scheme"]):
                continue
            base = _median(cases, runtime=c["runtime"], scheme=base_scheme, tokens=m)
            if base and c["median_s"]:
                rows.append({"runtime": c["runtime"], "scheme": c["scheme"], "median_s": c["median_s"],
                             "baseline_s": base, "speedup": base / c["median_s"],
                             "roofline_fraction": c.get("roofline_fraction")})
        best = max(rows, key=lambda r: r["speedup"], default=None)
        out.append({"goal": goal, "target": target, "tokens": m, "baseline": base_scheme, "kernels": rows,
                    "best": best, "met": None if best is None else best["speedup"] >= target})

    add(f"W4A16 at M=1 >= {W4A16_DECODE_TARGET}x over fp16", W4A16_DECODE_TARGET,
        lambda s: s.startswith("w4a16") or s in ("nf4", "fp4"), "fp16", 1)
    add(f"W8A8 / FP8 at M={big} >= {INT8_FP8_PREFILL_TARGET}x over bf16", INT8_FP8_PREFILL_TARGET,
        lambda s: s.startswith("w8a8") or s.startswith("fp8") or s.startswith("llm-int8"), "bf16", big)
    wall = doc.get("wall_s") or 0.0
    out.append({"goal": f"whole GPU sweep within {GPU_RUN_TARGET_S:.0f} s", "target": GPU_RUN_TARGET_S,
                "wall_s": wall, "met": wall <= GPU_RUN_TARGET_S, "kernels": [], "best": None})
    return out


def _db(value: float | None) -> str:
    return "-" if value is None else ("exact" if math.isinf(value) else f"{value:.1f}")


def _numerics_markdown(doc: Mapping[str, Any]) -> list[str]:
    from .render import markdown_table

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
            cell = _db(got["sqnr_db"])
            if got.get("sqnr_vs_reference_db") is not None:
                cell += f" / {_db(got['sqnr_vs_reference_db'])}"
            if got.get("disagrees"):
                cell += " **DIFFERS**"
            cells.append(cell)
        table.append([row["variant"], row["scheme"], _db(row["reference_sqnr_db"]), *cells])
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
            f"; best {best['speedup']:.2f}x ({best['runtime']} {best['scheme']}, {_ms(best['median_s'])} against "
            f"{_ms(best['baseline_s'])})" if best else ""))
        for k in sorted(t["kernels"], key=lambda r: -r["speedup"]):
            roof = k.get("roofline_fraction")
            lines.append(f"  - {k['runtime']} {k['scheme']}: {_ms(k['median_s'])}, {k['speedup']:.2f}x"
                         + (f", {100 * roof:.0f}% of the roofline" if roof is not None else ""))
    return lines + [""]


# --- Markdown -----------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g} ms"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def latency_markdown(doc: Mapping[str, Any]) -> str:
    """The Markdown report of a `BenchResult.to_dict()` document (pure: returns the text)."""
    from .render import markdown_table

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
                        cell = _ms(c["median_s"])
                        if c.get("speedup") is not None and scheme != c.get("baseline"):
                            cell += f" ({c['speedup']:.2f}x{' **SLOWER**' if c.get('slower_than_baseline') else ''})"
                        if c.get("roofline_fraction") is not None:
                            cell += f", {100 * c['roofline_fraction']:.0f}% roof"
                        cells.append(cell)
                first = next(c for c in rt_cases if c["spec_key"] == key and c["scheme"] == scheme)
                sqnr = first.get("sqnr_db")
                rows.append([spec["variant"], scheme, *cells, _bytes(first.get("weight_bytes")),
                             "exact" if sqnr is None and first.get("max_abs_error") == 0 else
                             (f"{sqnr:.1f}" if sqnr is not None else "-")])
        lines += [markdown_table(["variant", "scheme", *[f"M={m}" for m in tokens], "weights", "SQNR dB"], rows), ""]
    if any((c.get("roofline_fraction") or 0) > 1 for c in cases):
        lines += ["Roofline fractions above 100% mean the call beat the bandwidth it is measured against: "
                  "the weights stayed in cache, which the measured DRAM copy bandwidth does not model.", ""]
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
