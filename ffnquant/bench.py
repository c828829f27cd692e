"""The latency harness: variants x runtimes x formats x token counts, measured and returned as data.

Each case is warmed up, then timed call by call until a time budget (or a repeat cap) is
spent; `latency_stats` turns the samples into median/p10/p90/p99/mean/std. Derived
figures per case: tokens/s, bytes moved and FLOPs per call, achieved GB/s and TFLOP/s,
and the fraction of the device's roofline where its peaks are known. Every case slower
than its runtime's float baseline (fp32 on CPU, fp16 on GPU) is flagged. A runtime that
fails mid-sweep is recorded with its error and the sweep goes on. Each (spec, runtime, scheme)
is one task of an `executor` (here, or a Ray worker that stamps its host). Nothing here prints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .errors import FFNQuantError
from .infra.atomic import ScratchFolder
from .infra.envinfo import environment as current_environment
from .measure.executor import LocalExecutor
# The pure side (statistics, device peaks and the roofline, the numerics rows, the GPU targets) lives in
# ffnquant.measure.latency; re-exported here because callers know them as part of the harness.
from .measure.latency import (DEVICE_PEAKS, REFERENCE_TOLERANCE_DB, DevicePeaks, LatencyStats, device_peaks,
                              gpu_targets, latency_stats, numerics_rows, roofline, roofline_speedup_bound,
                              timing_suspect)
# The timers and the copy bandwidth live in ffnquant.measure.timing; re-exported as part of the harness too.
from .measure.timing import (CudaEventTimer, Timer, TimerFactory, WallTimer, default_timer, measure_copy_bandwidth,
                             time_calls, time_within_budget)
from .methods.fakequant import quantize_model
from .runtimes.artifacts import CALIBRATION_TOKENS, gaussian_calibration
from .runtimes.base import FORMATS, Loaded, ModelCase, Runtime, get_format, get_runtime, tensor_nbytes
from .schemes import PRESETS
from .spec import FFNSpec

__all__ = [
    "SCHEMA", "SCHEMA_VERSION", "DEFAULT_TOKENS", "REFERENCE_TOLERANCE_DB", "reference_output", "numerics_rows",
    "gpu_targets", "LatencyStats", "latency_stats", "Timer", "WallTimer", "CudaEventTimer", "default_timer",
    "DevicePeaks", "DEVICE_PEAKS", "device_peaks", "measure_copy_bandwidth", "roofline", "BenchConfig",
    "CaseResult", "BenchResult", "measure", "run_benchmark",
]

SCHEMA = "ffnquant.measure.latency"
SCHEMA_VERSION = 1
DEFAULT_TOKENS = (1, 16, 512, 2048)  # decode (1, 16) and prefill (512, 2048) tokens per call


# --- configuration and results -----------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    """How to measure: token counts per call, time budget per case, warm-up and repeat bounds."""

    tokens: tuple[int, ...] = DEFAULT_TOKENS
    budget_s: float = 0.5
    warmup: int = 3
    min_repeats: int = 5
    max_repeats: int = 100_000
    seed: int = 0
    accuracy_tokens: int = 64  # tokens of the once-per-model output check against fp32 torch
    measure_bandwidth: bool = False
    max_total_s: float | None = None  # whole-sweep limit: models not started by then are listed as skipped
    # Score each case also against ffnquant's own fake-quantized reference of the scheme of the
    # same name, so a kernel whose numerics differ from the preset is visible (see `REFERENCE_TOLERANCE_DB`).
    reference_check: bool = True

    def __post_init__(self) -> None:
        tokens = tuple(int(t) for t in self.tokens)
        if not tokens or any(t <= 0 for t in tokens):
            raise FFNQuantError(f"token counts must be positive integers, got {self.tokens!r}")
        object.__setattr__(self, "tokens", tuple(dict.fromkeys(tokens)))
        if not (isinstance(self.budget_s, (int, float)) and math.isfinite(self.budget_s) and self.budget_s > 0):
            raise FFNQuantError(f"budget_s must be a positive number of seconds, got {self.budget_s!r}")
        for name in ("warmup", "min_repeats", "max_repeats", "accuracy_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise FFNQuantError(f"{name} must be a {'non-negative' if name == 'warmup' else 'positive'} integer, got {value!r}")
        if self.max_total_s is not None and not self.max_total_s > 0:
            raise FFNQuantError(f"max_total_s must be positive, got {self.max_total_s!r}")
        if self.min_repeats > self.max_repeats:
            raise FFNQuantError(f"min_repeats {self.min_repeats} exceeds max_repeats {self.max_repeats}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tokens"] = list(self.tokens)
        return d


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass
class CaseResult:
    """One (variant, runtime, scheme, tokens) measurement, or the error that prevented it."""

    variant: str
    spec_key: str
    runtime: str
    scheme: str
    tokens: int
    device: str
    stats: LatencyStats | None = None
    error: str | None = None
    label: str = ""
    providers: tuple[str, ...] = ()
    weight_bytes: int | None = None
    file_bytes: int | None = None
    bytes_per_call: int | None = None
    flops_per_call: int | None = None
    compute: str | None = None
    roofline_fraction: float | None = None
    roofline_bound: str | None = None
    peak_memory_bytes: int | None = None
    sqnr_db: float | None = None
    max_abs_error: float | None = None
    reference_sqnr_db: float | None = None  # ffnquant's reference of the same scheme, against fp32
    sqnr_vs_reference_db: float | None = None  # this output against that reference's output
    reference_note: str | None = None  # why there is no reference, or how it was calibrated
    baseline: str | None = None
    speedup: float | None = None  # baseline median / this median
    slower_than_baseline: bool | None = None
    suspect: str | None = None  # why its timing is not to be trusted (latency.timing_suspect): never recommended
    host: str | None = None  # the machine that measured it (a Ray worker's, not the driver's)

    @property
    def ok(self) -> bool:
        return self.error is None and self.stats is not None

    @property
    def median_s(self) -> float | None:
        return self.stats.median_s if self.stats else None

    @property
    def disagrees_with_reference(self) -> bool | None:
        """True when this quantized kernel's SQNR is more than REFERENCE_TOLERANCE_DB from ffnquant's reference.

        None for float formats (their 60+ dB differ only in where fp16 rounds, which no recipe
        decision depends on) and where there is no reference.
        """
        if self.sqnr_db is None or self.reference_sqnr_db is None or FORMATS[self.scheme].scheme.weight_dtype.is_float:
            return None
        return abs(self.sqnr_db - self.reference_sqnr_db) > REFERENCE_TOLERANCE_DB

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.stats.median_s if self.stats and self.stats.median_s > 0 else None

    @property
    def achieved_gb_per_s(self) -> float | None:
        if not self.stats or not self.bytes_per_call or self.stats.median_s <= 0:
            return None
        return self.bytes_per_call / self.stats.median_s / 1e9

    @property
    def achieved_tflop_per_s(self) -> float | None:
        if not self.stats or not self.flops_per_call or self.stats.median_s <= 0:
            return None
        return self.flops_per_call / self.stats.median_s / 1e12

    def to_dict(self) -> dict[str, Any]:
        """Flat record: the stats fields (`median_s`, `p10_s`, ...) at the top level, None where absent."""
        stats = self.stats.to_dict() if self.stats else {f.name: None for f in dataclasses.fields(LatencyStats)}
        return {
            "variant": self.variant, "spec_key": self.spec_key, "runtime": self.runtime, "scheme": self.scheme,
            "tokens": self.tokens, "device": self.device, "host": self.host, **stats,
            "tokens_per_s": self.tokens_per_s, "bytes_per_call": self.bytes_per_call,
            "flops_per_call": self.flops_per_call, "achieved_gb_per_s": self.achieved_gb_per_s,
            "achieved_tflop_per_s": self.achieved_tflop_per_s, "compute": self.compute,
            "roofline_fraction": _finite(self.roofline_fraction), "roofline_bound": self.roofline_bound,
            "weight_bytes": self.weight_bytes, "file_bytes": self.file_bytes, "peak_memory_bytes": self.peak_memory_bytes,
            "sqnr_db": _finite(self.sqnr_db), "max_abs_error": _finite(self.max_abs_error),
            "reference_sqnr_db": _finite(self.reference_sqnr_db), "sqnr_vs_reference_db": _finite(self.sqnr_vs_reference_db),
            "disagrees_with_reference": self.disagrees_with_reference, "reference_note": self.reference_note,
            "baseline": self.baseline, "speedup": _finite(self.speedup), "slower_than_baseline": self.slower_than_baseline,
            "suspect": self.suspect,
            "label": self.label, "providers": list(self.providers), "error": self.error,
        }


@dataclass
class BenchResult:
    """Everything one sweep measured, with the environment it ran in."""

    config: BenchConfig
    specs: list[FFNSpec]
    runtimes: list[dict[str, Any]]
    cases: list[CaseResult]
    environment: dict[str, Any]
    device_peaks: dict[str, Any] = field(default_factory=dict)
    copy_bandwidth: dict[str, float] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)
    wall_s: float = 0.0
    command: str | None = None

    def case(self, variant: str, runtime: str, scheme: str, tokens: int) -> CaseResult:
        """The case with these keys (KeyError if it was not run)."""
        for c in self.cases:
            if (c.variant, c.runtime, c.scheme, c.tokens) == (variant, runtime, scheme, tokens):
                return c
        raise KeyError((variant, runtime, scheme, tokens))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "command": self.command,
            "config": self.config.to_dict(),
            "environment": self.environment,
            "specs": [s.to_dict() for s in self.specs],
            "formats": {name: FORMATS[name].to_dict() for name in sorted({c.scheme for c in self.cases})},
            "runtimes": self.runtimes,
            "device_peaks": self.device_peaks,
            "copy_bandwidth_bytes_per_s": self.copy_bandwidth,
            "skipped": self.skipped,
            "cases": [c.to_dict() for c in self.cases],
            "wall_s": self.wall_s,
        }


# --- measuring ----------------------------------------------------------------------------------
def measure(runtime: Runtime, loaded: Loaded, x: np.ndarray, config: BenchConfig, timer: Timer) -> LatencyStats:
    """Warm up, then time single calls until `config.budget_s` of timed calls (at least `min_repeats`):
    `timing.time_within_budget` on this runtime's call."""
    prepared = runtime.prepare(loaded, x)
    time_calls(lambda: runtime.run(loaded, prepared), 0, warmup=config.warmup)
    runtime.synchronize(loaded)
    return latency_stats(time_within_budget(lambda: runtime.run(loaded, prepared), config.budget_s,
                                            config.min_repeats, config.max_repeats, timer))


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def _device_name(runtime: Runtime, environment: Mapping[str, Any]) -> str:
    if runtime.device == "cuda":
        gpu = environment.get("gpu") or {}
        return str(gpu.get("name") or "cuda")
    return str(environment.get("cpu") or "cpu")


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(np.sum((got - ref) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(ref**2)) / noise)


def _output_check(runtime: Runtime, loaded: Loaded, x: np.ndarray, ref: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(SQNR in dB, max |error|, the output) of the runtime's output against fp32 torch on the same input."""
    got = runtime(loaded, x).reshape(ref.shape).astype(np.float64)
    return _sqnr(ref, got), float(np.max(np.abs(got - ref))), got


def reference_output(model: Any, scheme_name: str, x: np.ndarray, seed: int = 0,
                     calibration: Callable[[], Any] | None = None) -> tuple[np.ndarray | None, str]:
    """ffnquant's fake-quantized reference of the preset called `scheme_name` on `x` (float64), with a note.

    Static presets are calibrated like the ONNX artifacts the onnxruntime adapters time
    (`runtimes.artifacts.gaussian_calibration`); `calibration` returns that Prepared, so a sweep
    calibrates each model once for all its static schemes. Returns (None, reason) where there is
    no such preset, where ffnquant's fake quantization does not reproduce it
    (`Scheme.no_reference_reason`: `bf16`, bitsandbytes' LLM.int8 outlier split) or where it
    cannot be built here (nf4/fp4 without bitsandbytes). The GPU kernels' figures are compared with this.
    """
    import torch

    if scheme_name == "fp32":
        return None, "fp32 is the reference itself"
    if scheme_name not in PRESETS:
        return None, f"no ffnquant scheme called {scheme_name!r}"
    scheme = PRESETS[scheme_name]
    if scheme.no_reference_reason is not None:
        return None, f"no reference: {scheme.no_reference_reason}"
    try:
        if scheme.static_activations:
            prep = calibration() if calibration is not None else gaussian_calibration(model, seed)
            qmodel = quantize_model(prep.model, scheme, prep.table)
            note = f"static ranges calibrated ({scheme.calibrator}) on {CALIBRATION_TOKENS} Gaussian tokens"
        else:
            qmodel, note = quantize_model(model, scheme), "no calibration needed"
        with torch.inference_mode():
            out = qmodel(torch.from_numpy(x)).double().numpy()
    except FFNQuantError as exc:
        return None, f"reference unavailable: {exc}"
    return out, note


def run_benchmark(
    specs: Sequence[FFNSpec],
    runtimes: Sequence[str | Runtime],
    schemes: Sequence[str] | None = None,
    config: BenchConfig = BenchConfig(),
    *,
    models: Mapping[str, Any] | None = None,
    onnx_paths: Mapping[tuple[str, str], str | Path] | None = None,
    workdir: str | Path | None = None,
    timer_factory: TimerFactory = default_timer,
    progress: Callable[[int, int, str], None] | None = None,
    environment: Mapping[str, Any] | None = None,
    executor: Any = None,
) -> BenchResult:
    """Measure every spec x available runtime x scheme (that runtime supports) x token count.

    `schemes=None` runs every format each runtime supports; each runtime's float baseline
    is added when missing so that slowdowns can be flagged. Unavailable runtimes are
    recorded with their reason and skipped; a failure while loading or running records an
    error on its cases and the sweep continues. `models` maps spec.key to float FFNs
    (default: built from `config.seed`); `onnx_paths` maps (spec.key, scheme) to prebuilt
    ONNX files for the onnxruntime adapters; others are built under `workdir` (a temporary
    folder by default). `progress(done, total, label)` is called after each case. Each
    (spec, runtime, scheme) is a task of `executor` (default: this process, in order); each
    case names its host.
    """
    t_start = time.perf_counter()
    executor = executor if executor is not None else LocalExecutor()
    env = dict(environment) if environment is not None else current_environment()
    # Other processes on the machine distort CPU timings; the load average says how much.
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    adapters = [get_runtime(r) if isinstance(r, str) else r for r in runtimes]
    requested = None if schemes is None else [FORMATS[s].name if s in FORMATS else s for s in schemes]
    for s in requested or ():
        get_format(s)  # an unknown name raises the error listing the valid ones

    runtime_rows: list[dict[str, Any]] = []
    plan: list[tuple[Runtime, list[str]]] = []
    skipped: list[dict[str, str]] = []
    for rt in adapters:
        avail = rt.availability()
        runtime_rows.append({"name": rt.name, "device": avail.device, "available": avail.available,
                             "reason": avail.reason, "error": None, "ran_with": []})
        if not avail.available:
            continue
        formats = rt.formats
        wanted = list(formats) if requested is None else [s for s in requested if s in formats]
        for s in requested or []:
            if s not in formats:
                skipped.append({"runtime": rt.name, "scheme": s, "reason": f"{rt.name} does not support {s}"})
        if rt.baseline in formats and rt.baseline not in wanted:
            wanted.insert(0, rt.baseline)
        plan.append((rt, wanted))

    total = len(specs) * sum(len(w) for _, w in plan) * len(config.tokens)
    done = 0

    def case_done(c: CaseResult) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total, f"{c.variant} {c.runtime} {c.scheme} M={c.tokens}{': error' if c.stats is None else ''}")

    tmp_ctx = ScratchFolder("bench") if workdir is None else None
    sweep = _Sweep(uuid.uuid4().hex, config, env, socket.gethostname(), timer_factory, requested is None,
                   None if config.max_total_s is None else time.time() + config.max_total_s,
                   # in this process: one artifact folder and progress per case, as the cases finish
                   Path(tmp_ctx.name if tmp_ctx else workdir) if executor.in_process else None,
                   case_done if executor.in_process else None)
    tasks = [_CaseTask(sweep, spec, (models or {}).get(spec.key), rt, scheme, (onnx_paths or {}).get((spec.key, scheme)))
             for spec in specs for rt, wanted in plan for scheme in wanted]
    gpus = not executor.in_process and executor.describe().get("gpus")  # a CUDA case asks Ray for a GPU node
    results: dict[int, _CaseDone] = {}
    try:
        for i, res in executor.as_completed(_run_case_task, tasks,
                                            [{"num_gpus": 1} if gpus and t.runtime.device == "cuda" else {} for t in tasks]):
            results[i] = res
            total -= 0 if res.skipped is None else len(config.tokens)
            for c in () if executor.in_process else res.cases:  # from a worker: progress as its task returns
                case_done(c)
    finally:
        _SWEEP.clear()
        if tmp_ctx is not None:
            tmp_ctx.cleanup()

    cases, peaks_used, copy_bw = [], {}, {}
    for task, res in ((tasks[i], results[i]) for i in range(len(tasks))):
        cases += res.cases
        skipped += [res.skipped] if res.skipped else []
        row = next(r for r in runtime_rows if r["name"] == task.runtime.name)
        if res.label is not None and res.label not in row["ran_with"]:
            row["ran_with"].append(res.label)
        if res.peaks is not None:
            peaks_used[task.runtime.device] = res.peaks
        if res.copy_bw is not None:
            copy_bw.setdefault(task.runtime.device, res.copy_bw)
    _flag_slowdowns(cases, {rt.name: rt.baseline for rt, _ in plan})
    for row in runtime_rows:
        errors = [c.error for c in cases if c.runtime == row["name"] and c.error]
        if errors:
            row["error"] = f"{len(errors)} case(s) failed; first: {errors[0]}"
    if load_before is not None:
        env["load_average"] = {"before": [round(v, 2) for v in load_before],
                               "after": [round(v, 2) for v in os.getloadavg()]}
    env["executor"] = executor.describe()
    return BenchResult(config=config, specs=list(specs), runtimes=runtime_rows, cases=cases, environment=env,
                       device_peaks=peaks_used, copy_bandwidth=copy_bw, skipped=skipped,
                       wall_s=time.perf_counter() - t_start)


@dataclass(frozen=True)
class _Sweep:
    """What every task of one sweep carries."""

    id: str  # what a process keeps of one sweep (`_SWEEP`) never serves another
    config: BenchConfig
    environment: Mapping[str, Any]  # the driver's; a task on another host names that host's devices
    driver_host: str
    timer_factory: TimerFactory
    every_format: bool  # 'all' schemes: sizes a kernel cannot take are skipped, not errors
    deadline: float | None  # time.time() after which no case starts (max_total_s)
    workdir: Path | None  # the sweep's artifact folder; None: each task its own (tasks run at once)
    on_case: Callable[[CaseResult], None] | None  # live progress, in the driver's process only


@dataclass(frozen=True)
class _CaseTask:
    """One task: a (spec, runtime, scheme) loaded once and timed at every token count."""

    sweep: _Sweep
    spec: FFNSpec
    model: Any  # the float FFN given for this spec, or None: built from the seed where the task runs
    runtime: Runtime
    scheme: str
    onnx_path: Any


@dataclass
class _CaseDone:
    cases: list[CaseResult] = field(default_factory=list)
    skipped: dict[str, str] | None = None
    label: str | None = None
    peaks: dict[str, Any] | None = None
    copy_bw: float | None = None


# What this process keeps of the sweep under way: each spec's model, inputs and references, the copy
# bandwidth per device, another host's environment. Cleared when the sweep ends here; a Ray worker
# starts afresh when a task of another sweep arrives.
_SWEEP: dict[str, Any] = {}


class _SpecState:
    """A spec's float model, timed inputs, accuracy input and fp32 output; its references, once per scheme."""

    def __init__(self, spec: FFNSpec, model: Any, config: BenchConfig) -> None:
        import torch

        from .model import build

        self.config, self.calibrated, self.references = config, None, {}
        self.model = model if model is not None else build(spec, seed=config.seed)
        rng = np.random.default_rng(config.seed)
        self.inputs = {m: rng.standard_normal((1, m, spec.d_model)).astype(np.float32) for m in config.tokens}
        check_tokens = min(config.accuracy_tokens, max(config.tokens))
        self.x_check = rng.standard_normal((1, check_tokens, spec.d_model)).astype(np.float32)
        with torch.inference_mode():
            self.ref = self.model.float()(torch.from_numpy(self.x_check)).double().numpy()

    def calibration(self) -> Any:
        """This model's Gaussian calibration, made once for all its static schemes."""
        from .runtimes.artifacts import gaussian_calibration

        if self.calibrated is None:
            self.calibrated = gaussian_calibration(self.model, self.config.seed)
        return self.calibrated

    def reference(self, scheme: str) -> tuple[np.ndarray | None, str, float | None]:
        if scheme not in self.references:
            out, note = (reference_output(self.model, scheme, self.x_check, self.config.seed, self.calibration)
                         if self.config.reference_check else (None, "reference check off"))
            self.references[scheme] = (out, note, None if out is None else _sqnr(self.ref, out))
        return self.references[scheme]


def _run_case_task(task: _CaseTask) -> _CaseDone:
    """One task where it landed: load, check the output once, time every token count."""
    sweep, spec, rt, scheme, host = task.sweep, task.spec, task.runtime, task.scheme, socket.gethostname()
    config, done = sweep.config, _CaseDone()
    if _SWEEP.get("id") != sweep.id:
        _SWEEP.clear()
        _SWEEP.update(id=sweep.id, specs={}, bandwidth={})
    if sweep.deadline is not None and time.time() > sweep.deadline:
        done.skipped = {"runtime": rt.name, "scheme": scheme, "variant": spec.variant.value,
                        "reason": f"sweep time limit of {config.max_total_s:g} s reached"}
        return done
    at_home = host == sweep.driver_host
    if not at_home and "env" not in _SWEEP:
        from .infra.envinfo import environment

        _SWEEP["env"] = environment()
    device_name = _device_name(rt, sweep.environment if at_home else _SWEEP["env"])
    peaks = device_peaks(device_name) if rt.device == "cuda" else None
    done.peaks = None if peaks is None else {"device": device_name, **peaks.to_dict()}
    if config.measure_bandwidth:  # once per device in each process
        bandwidth = _SWEEP["bandwidth"]
        done.copy_bw = bandwidth[rt.device] = bandwidth.get(rt.device) or measure_copy_bandwidth(rt.device)
    case = ModelCase(spec, scheme, seed=config.seed, max_tokens=max(config.tokens), onnx_path=task.onnx_path)
    if sweep.every_format:
        try:
            rt.check(case)
        except FFNQuantError as exc:
            done.skipped = {"runtime": rt.name, "scheme": scheme, "variant": spec.variant.value, "reason": str(exc)}
            return done

    def record(m: int, **kw: Any) -> None:
        done.cases.append(CaseResult(spec.variant.value, spec.key, rt.name, scheme, m, device_name, host=host, **kw))
        if sweep.on_case is not None:
            sweep.on_case(done.cases[-1])

    avail = rt.availability() if at_home else rt._check_availability()  # this host's, not the driver's cached one
    if not avail.available:
        for m in config.tokens:
            record(m, error=f"{rt.name} is not available on {host}: {avail.reason}")
        return done
    state = _SWEEP["specs"].get(spec.key) or _SWEEP["specs"].setdefault(spec.key, _SpecState(spec, task.model, config))
    with ScratchFolder("bench") as own:
        loaded = None
        try:
            rt.reset_peak_memory()
            loaded = rt.load(dataclasses.replace(case, model=state.model, workdir=sweep.workdir or Path(own)))
            sqnr, max_err, got = _output_check(rt, loaded, state.x_check, state.ref)
        except Exception as exc:  # a failing runtime is a result, not the end of the sweep
            for m in config.tokens:
                record(m, error=_error_text(exc))
            if loaded is not None:
                rt.release(loaded)
            return done
        done.label, compute = loaded.label, FORMATS[scheme].compute.value
        ref_out, ref_note, ref_sqnr = state.reference(scheme)
        if loaded.extra.get("int8_kernel"):  # why this kernel may disagree with the reference (ortcpu)
            ref_note = "; ".join(n for n in (ref_note, loaded.extra["int8_kernel"]) if n)
        vs_ref = None if ref_out is None else _sqnr(ref_out, got)
        for m in config.tokens:
            act_bytes = sum(tensor_nbytes(dtype, m * spec.d_model) for dtype in (loaded.input_dtype, loaded.output_dtype))
            base_kw = dict(label=loaded.label, providers=loaded.providers, weight_bytes=loaded.weight_bytes,
                           file_bytes=loaded.file_bytes, bytes_per_call=loaded.weight_bytes + act_bytes,
                           flops_per_call=m * spec.flops_per_token, compute=compute, sqnr_db=sqnr, max_abs_error=max_err,
                           reference_sqnr_db=ref_sqnr, sqnr_vs_reference_db=vs_ref, reference_note=ref_note)
            try:
                stats = measure(rt, loaded, state.inputs[m], config, sweep.timer_factory(rt, loaded))
            except Exception as exc:
                record(m, error=_error_text(exc), **base_kw)
            else:
                frac, bound = roofline(base_kw["bytes_per_call"], base_kw["flops_per_call"], stats.median_s, compute,
                                       peaks, done.copy_bw)
                record(m, stats=stats, roofline_fraction=frac, roofline_bound=bound,
                       peak_memory_bytes=rt.peak_memory_bytes(), **base_kw)
        rt.release(loaded)
    return done


def _flag_slowdowns(cases: list[CaseResult], baselines: Mapping[str, str]) -> None:
    """Set speedup (baseline median / median) and slower_than_baseline on every measured case.

    Slower means beyond the measured spread: the case's p10 above the baseline's p90, the mirror of
    the recommender's test for faster. A median a hair above the baseline's is noise, not a slowdown.
    A case is compared with the baseline measured on its own host only. A timing not to be trusted (too few
    samples, a ratio the roofline does not allow) is marked `suspect`."""
    index = {(c.spec_key, c.runtime, c.tokens, c.host): c for c in cases if c.ok and c.scheme == baselines.get(c.runtime)}
    for c in cases:
        base = index.get((c.spec_key, c.runtime, c.tokens, c.host))
        if c.ok:
            c.suspect = timing_suspect(c.stats.n)
        if not c.ok or base is None:
            continue
        c.baseline = base.scheme
        c.speedup = base.stats.median_s / c.stats.median_s if c.stats.median_s > 0 else None
        c.slower_than_baseline = c.scheme != base.scheme and c.stats.p10_s > base.stats.p90_s
        if c.suspect is None and c.scheme != base.scheme and None not in (c.bytes_per_call, base.bytes_per_call):
            bound = roofline_speedup_bound(base.bytes_per_call, base.flops_per_call or 0, base.compute or "fp32",
                                           c.bytes_per_call, c.flops_per_call or 0, c.compute or "fp32",
                                           device_peaks(c.device))
            both_float = all(FORMATS[s].scheme.weight_dtype.is_float for s in (c.scheme, base.scheme))
            c.suspect = timing_suspect(c.stats.n, c.speedup, bound, base.scheme, both_float)
