"""Latency arithmetic: per-call statistics of timed samples, device peaks and the roofline, the
cross-runtime numerics rows and the GPU targets of a `bench.BenchResult.to_dict()` document. Pure
functions of measured numbers; `ffnquant.report.latency` renders them, `ffnquant.bench` measures.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import FFNQuantError

__all__ = [
    "LatencyStats",
    "latency_stats",
    "DevicePeaks",
    "DEVICE_PEAKS",
    "device_peaks",
    "roofline",
    "roofline_speedup_bound",
    "timing_suspect",
    "MIN_TIMED_SAMPLES",
    "REFERENCE_TOLERANCE_DB",
    "numerics_rows",
    "gpu_targets",
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


# --- timings not to trust ---------------------------------------------------------------------------
# A timed case needs this many samples before its median is compared with anything: with two, one stall of the
# machine (another process, a page fault) is half the median.
MIN_TIMED_SAMPLES = 5
# Two kernels need not run at the same fraction of their roofline: the room left for that, on either side.
ROOFLINE_SLACK = 2.0
# A float format's case slower than its float baseline by more than this (either way, fp16 against fp32) is
# not a kernel's cost but the machine's: a software-emulated fp16 GEMM costs a few times fp32, not fifty.
FLOAT_RATIO_LIMIT = 8.0
# Compute gain over fp32 where the device's peaks are not tabled (CPUs): fp16 packs twice the lanes of fp32,
# int8 and fp8 dot-product instructions (VNNI, SDOT) do four times the multiply-adds of an fp32 FMA.
CPU_COMPUTE_GAIN = {"fp32": 1.0, "fp16": 2.0, "int8": 4.0, "fp8": 4.0}


def roofline_speedup_bound(base_bytes: float, base_flops: float, base_compute: str, bytes_moved: float,
                           flops: float, compute: str, peaks: DevicePeaks | None = None) -> float:
    """The largest speedup over its baseline that the roofline allows a case on the same device.

    Roofline time is max(bytes / bandwidth, flops / peak); the bandwidth is the device's for both, so the
    baseline's time over the case's is at most the larger of base bytes / bytes (memory side) and
    (base flops / base peak) / (flops / peak) (compute side), times ROOFLINE_SLACK. Peaks from the device table,
    else CPU_COMPUTE_GAIN."""
    ops = peaks.ops_per_s if peaks is not None else {}
    if ops.get(compute) and ops.get(base_compute):
        gain = ops[compute] / ops[base_compute]
    else:
        gain = CPU_COMPUTE_GAIN.get(compute, 1.0) / CPU_COMPUTE_GAIN.get(base_compute, 1.0)
    memory = base_bytes / bytes_moved if bytes_moved > 0 else 1.0
    compute_side = base_flops / flops * gain if flops > 0 else 1.0
    return max(1.0, memory, compute_side) * ROOFLINE_SLACK


def timing_suspect(n: int, speedup: float | None = None, bound: float | None = None, baseline: str = "",
                   both_float: bool = False) -> str | None:
    """Why a timed case is not to be trusted (None: it is): too few samples, a speedup over its baseline beyond
    the roofline's `bound`, or a float format more than FLOAT_RATIO_LIMIT from its float baseline either way."""
    if n < MIN_TIMED_SAMPLES:
        return f"{n} sample{'s' if n != 1 else ''} (fewer than {MIN_TIMED_SAMPLES})"
    if speedup is None or speedup <= 0:
        return None
    if bound is not None and speedup > bound:
        return f"{speedup:.3g}x faster than {baseline}, beyond the roofline's {bound:.3g}x"
    if both_float and max(speedup, 1 / speedup) > FLOAT_RATIO_LIMIT:
        way = "faster" if speedup > 1 else "slower"
        return (f"{max(speedup, 1 / speedup):.3g}x {way} than {baseline}, beyond the {FLOAT_RATIO_LIMIT:g}x "
                "a float format can differ by")
    return None


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


# The GPU targets the latency report checks, on the figures of the run itself.
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
