"""The latency harness on fake timers and a fake runtime: statistics, loop bounds, roofline, flags, errors, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ffnquant.bench import (
    BenchConfig,
    WallTimer,
    device_peaks,
    latency_stats,
    measure,
    roofline,
    run_benchmark,
)
from ffnquant.cli import main
from ffnquant.report.latency import latency_markdown
from ffnquant.errors import FFNQuantError
from ffnquant.runtimes.base import Availability, Loaded, ModelCase, Runtime, check_input
from ffnquant.spec import FFNSpec

D = 32


# --- statistics -------------------------------------------------------------------------------
def test_latency_stats_hand_derived():
    # samples 1..10 (shuffled): linear-interpolated percentile p at rank (n-1) p/100 = 9 p/100
    # p10 -> rank 0.9 -> 1.9; p50 -> rank 4.5 -> 5.5; p90 -> rank 8.1 -> 9.1; p99 -> rank 8.91 -> 9.91
    s = latency_stats([3, 1, 2, 10, 9, 4, 8, 5, 7, 6])
    assert (s.n, s.min_s, s.max_s) == (10, 1.0, 10.0)
    assert s.median_s == pytest.approx(5.5)
    assert s.p10_s == pytest.approx(1.9)
    assert s.p90_s == pytest.approx(9.1)
    assert s.p99_s == pytest.approx(9.91)
    assert s.mean_s == pytest.approx(5.5)
    assert s.std_s == pytest.approx(math.sqrt(82.5 / 9))  # sum of squared deviations 82.5, n - 1 = 9


def test_latency_stats_single_sample():
    s = latency_stats([0.25])
    assert (s.median_s, s.p10_s, s.p99_s, s.std_s) == (0.25, 0.25, 0.25, 0.0)


@pytest.mark.parametrize("bad", [[], [1.0, -1.0], [float("nan")]], ids=["empty", "negative", "nan"])
def test_latency_stats_rejects_bad_samples(bad):
    with pytest.raises(FFNQuantError):
        latency_stats(bad)


@pytest.mark.parametrize(
    "kwargs",
    [dict(tokens=(0,)), dict(budget_s=0), dict(min_repeats=10, max_repeats=5), dict(warmup=-1)],
    ids=["zero-tokens", "zero-budget", "min-over-max", "negative-warmup"],
)
def test_bench_config_validates(kwargs):
    with pytest.raises(FFNQuantError):
        BenchConfig(**kwargs)


# --- a fake runtime and a fake timer ---------------------------------------------------------------
class FakeTimer:
    """Each stop() returns the next duration (cycling)."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.i = 0

    def start(self):
        pass

    def stop(self):
        d = self.durations[self.i % len(self.durations)]
        self.i += 1
        return d


class FakeRuntime(Runtime):
    """Runs the float FFN in torch; `fail` makes load or run raise, to test error recording."""

    def __init__(self, name="fake-cpu", formats=("fp32", "fp16", "w8a16"), available=True, fail=None):
        self.name, self._formats, self._available, self.fail = name, tuple(formats), available, fail
        self.device = "cpu"
        self.baseline = "fp32"
        self.calls = 0

    def _check_availability(self):
        return Availability(self._available, "fake" if self._available else "fake runtime switched off", "cpu")

    @property
    def formats(self):
        return self._formats

    def load(self, case: ModelCase) -> Loaded:
        self.check(case)
        if self.fail == "load":
            raise RuntimeError("driver exploded\nsecond line")
        return Loaded(self.name, case, case.float_model(), "cpu", f"fake {case.scheme}", 1000, "float32", "float32")

    def prepare(self, loaded, x):
        return torch.from_numpy(check_input(x, loaded.spec))

    def run(self, loaded, prepared):
        self.calls += 1
        if self.fail == "run" and prepared.shape[-2] > 2:
            raise RuntimeError("out of memory")
        with torch.no_grad():
            return loaded.handle(prepared)

    def to_numpy(self, loaded, output):
        return output.numpy()


@pytest.fixture
def spec():
    return FFNSpec("relu", d_model=D)


def test_measure_stops_at_budget_but_not_before_min_repeats(spec):
    rt = FakeRuntime()
    loaded = rt.load(ModelCase(spec, "fp32"))
    x = np.zeros((1, 2, D), np.float32)
    cfg = BenchConfig(budget_s=0.35, warmup=2, min_repeats=5)
    stats = measure(rt, loaded, x, cfg, FakeTimer([0.125]))  # 1/8: exact in binary, so sums are exact
    assert stats.n == 5  # the budget is reached at 3 calls, the floor asks for 5
    assert rt.calls == 2 + 5  # warm-up calls are run but not timed
    stats = measure(rt, loaded, x, BenchConfig(budget_s=1.0, warmup=0, min_repeats=1), FakeTimer([0.125]))
    assert stats.n == 8
    stats = measure(rt, loaded, x, BenchConfig(budget_s=100.0, warmup=0, min_repeats=1, max_repeats=7),
                    FakeTimer([0.125]))
    assert stats.n == 7
    stats = measure(rt, loaded, x, BenchConfig(budget_s=1.0, warmup=0, min_repeats=1), FakeTimer([0.25, 0.5]))
    assert (stats.n, stats.median_s, stats.mean_s) == (3, 0.25, pytest.approx(1 / 3))  # 0.25 + 0.5 + 0.25


def test_wall_timer_synchronises_around_the_call():
    events = []
    timer = WallTimer(lambda: events.append("sync"))
    timer.start()
    assert timer.stop() >= 0.0 and events == ["sync", "sync"]


def test_time_calls_warms_up_untimed_then_times_each_call():
    """The fixed-count loop the timings outside the runtime adapters share: warm-up calls are not timed."""
    from ffnquant.measure.timing import time_calls

    events = []

    class Recording:
        def start(self):
            events.append("start")

        def stop(self):
            events.append("stop")
            return 0.5

    samples = time_calls(lambda: events.append("call"), 2, warmup=1, timer=Recording())
    assert samples == [0.5, 0.5]
    assert events == ["call", "start", "call", "stop", "start", "call", "stop"]
    assert len(time_calls(lambda: None, 3)) == 3 and all(t >= 0.0 for t in time_calls(lambda: None, 3))


# --- roofline ---------------------------------------------------------------------------------
def test_device_peaks_by_name():
    assert device_peaks("NVIDIA H200").name == "H200"
    assert device_peaks("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert device_peaks("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert device_peaks("AMD EPYC 7B13") is None
    assert device_peaks(None) is None


def test_roofline_memory_and_compute_bound():
    h200 = device_peaks("NVIDIA H200")
    # 4.8 GB at 4.8 TB/s takes 1 ms; measured 2 ms -> half the roofline, memory-bound
    frac, bound = roofline(4.8e9, 1e9, 2e-3, "fp16", h200)
    assert frac == pytest.approx(0.5) and bound == "memory"
    # 989 TFLOP in 1 s at the bf16 peak; measured 4 s -> a quarter, compute-bound
    frac, bound = roofline(1.0, 989e12, 4.0, "fp16", h200)
    assert frac == pytest.approx(0.25) and bound == "compute"
    # int8 uses the int8 peak (2x)
    assert roofline(1.0, 1979e12, 4.0, "int8", h200)[0] == pytest.approx(0.25)
    # CPU: unknown unless a copy bandwidth was measured
    assert roofline(1e9, 1e9, 1.0, "fp32", None) == (None, None)
    frac, bound = roofline(1e9, 1e9, 1.0, "fp32", None, copy_bandwidth=10e9)
    assert frac == pytest.approx(0.1) and bound.startswith("memory")


# --- the sweep ------------------------------------------------------------------------------------
def _timers(durations_by_scheme):
    return lambda rt, loaded: FakeTimer([durations_by_scheme[loaded.case.scheme]])


ENV = {"cpu": "fake cpu", "cpu_count": 2, "torch_threads": 2, "packages": {}}


def test_a_median_inside_the_baselines_spread_is_not_flagged_slower(spec):
    """0.5% above the baseline's median but inside its p10-p90 spread: noise, not a slowdown (the GPU
    report printed '1.00x **SLOWER**')."""
    spread = [0.0009, 0.001, 0.0011]
    timers = {"fp32": spread, "fp16": [0.000905, 0.001005, 0.001105]}
    cfg = BenchConfig(tokens=(1,), budget_s=0.05, warmup=0, min_repeats=3)
    result = run_benchmark([spec], [FakeRuntime()], ["fp16"], cfg, environment=ENV,
                           timer_factory=lambda rt, loaded: FakeTimer(timers[loaded.case.scheme]))
    case = result.case("relu", "fake-cpu", "fp16", 1)
    assert case.speedup < 1 and case.slower_than_baseline is False


def test_sweep_flags_slowdowns_and_derives_figures(spec):
    cfg = BenchConfig(tokens=(1, 4), budget_s=0.05, warmup=0, min_repeats=3)
    progress = []
    result = run_benchmark([spec], [FakeRuntime()], ["fp16", "w8a16"], cfg,
                           timer_factory=_timers({"fp32": 0.002, "fp16": 0.001, "w8a16": 0.004}),
                           progress=lambda done, total, label: progress.append((done, total)), environment=ENV)
    # the fp32 baseline is added although only fp16 and w8a16 were asked for
    assert [c.scheme for c in result.cases] == ["fp32", "fp32", "fp16", "fp16", "w8a16", "w8a16"]
    assert progress[-1] == (6, 6) and [d for d, _ in progress] == list(range(1, 7))
    fast, slow = result.case("relu", "fake-cpu", "fp16", 4), result.case("relu", "fake-cpu", "w8a16", 4)
    assert fast.speedup == pytest.approx(2.0) and fast.slower_than_baseline is False
    assert slow.speedup == pytest.approx(0.5) and slow.slower_than_baseline is True
    assert result.case("relu", "fake-cpu", "fp32", 1).slower_than_baseline is False
    assert fast.tokens_per_s == pytest.approx(4 / 0.001)
    assert fast.flops_per_call == 4 * spec.flops_per_token
    assert fast.bytes_per_call == 1000 + 2 * 4 * D * 4  # weights + fp32 input and output
    assert fast.achieved_gb_per_s == pytest.approx(fast.bytes_per_call / 0.001 / 1e9)
    assert fast.sqnr_db is not None and fast.sqnr_db > 100  # the fake runs the float model itself
    doc = result.to_dict()
    assert doc["schema"] == "ffnquant.measure.latency" and doc["schema_version"] == 1
    json.dumps(doc, allow_nan=False)  # strict JSON: no inf/nan
    md = latency_markdown(doc)
    assert "**SLOWER**" in md and "(2.00x)" in md and "fake-cpu" in md


def test_sweep_records_failures_and_continues(spec):
    cfg = BenchConfig(tokens=(1, 4), budget_s=0.01, warmup=0, min_repeats=1, accuracy_tokens=2)
    runtimes = [FakeRuntime("broken", fail="load"), FakeRuntime("flaky", fail="run"),
                FakeRuntime("off", available=False), FakeRuntime("good")]
    result = run_benchmark([spec], runtimes, ["fp32"], cfg, timer_factory=_timers({"fp32": 0.001}), environment=ENV)
    broken = [c for c in result.cases if c.runtime == "broken"]
    assert [c.error for c in broken] == ["RuntimeError: driver exploded"] * 2
    assert result.case("relu", "flaky", "fp32", 1).ok
    assert result.case("relu", "flaky", "fp32", 4).error == "RuntimeError: out of memory"
    assert all(c.ok for c in result.cases if c.runtime == "good")
    assert not any(c.runtime == "off" for c in result.cases)
    rows = {r["name"]: r for r in result.runtimes}
    assert rows["off"]["available"] is False and rows["off"]["reason"] == "fake runtime switched off"
    assert "driver exploded" in rows["broken"]["error"] and rows["good"]["error"] is None
    assert "## Errors" in latency_markdown(result.to_dict())


def test_sweep_skips_unsupported_schemes_of_a_runtime(spec):
    result = run_benchmark([spec], [FakeRuntime(formats=("fp32",))], ["fp32", "w8a16"],
                           BenchConfig(tokens=(1,), budget_s=0.01, warmup=0, min_repeats=1),
                           timer_factory=_timers({"fp32": 0.001}), environment=ENV)
    assert [c.scheme for c in result.cases] == ["fp32"]
    assert result.skipped == [{"runtime": "fake-cpu", "scheme": "w8a16", "reason": "fake-cpu does not support w8a16"}]


def test_sweep_rejects_unknown_scheme(spec):
    with pytest.raises(FFNQuantError, match="unknown scheme 'int3'"):
        run_benchmark([spec], [FakeRuntime()], ["int3"], environment=ENV)


def test_sweep_on_real_cpu_runtime(spec):
    """torch-cpu end to end with the real timer: a tiny budget, two token counts."""
    cfg = BenchConfig(tokens=(1, 8), budget_s=0.005, warmup=1, min_repeats=2)
    result = run_benchmark([spec], ["torch-cpu"], ["fp32", "w8a8-dynamic-s8"], cfg)
    assert all(c.ok for c in result.cases), [c.error for c in result.cases]
    dyn = result.case("relu", "torch-cpu", "w8a8-dynamic-s8", 8)
    assert dyn.weight_bytes < result.case("relu", "torch-cpu", "fp32", 8).weight_bytes
    assert dyn.sqnr_db > 25  # int8 per-token x per-channel: ~35 dB on Gaussian inputs
    assert result.environment["load_average"]["before"]


# --- the command ---------------------------------------------------------------------------------
def test_cli_writes_json_and_markdown(tmp_path, capsys):
    rc = main(["bench", "--variants", "relu", "--d-model", str(D), "--runtimes", "torch-cpu", "--schemes",
               "fp32,bf16", "--tokens", "1,4", "--budget-s", "0.005", "--warmup", "1", "--min-repeats", "2",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "latency.json").read_text())
    assert doc["command"].startswith("ffnquant bench --variants relu --d-model 32")
    assert {c["scheme"] for c in doc["cases"]} == {"fp32", "bf16"}
    assert doc["environment"]["packages"]["torch"]
    md = (tmp_path / "latency.md").read_text()
    assert "### torch-cpu" in md and doc["command"] in md
    assert "4 cases measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runtimes", "tensorflow"], "unknown runtime 'tensorflow'; valid: ort-cpu"),
        (["--runtimes", "ort-cpu", "--schemes", "bf16"], "scheme 'bf16' is not supported by ort-cpu"),
        (["--runtimes", "torch-cpu", "--schemes", "int3"], "unknown scheme 'int3'"),
        (["--runtimes", "torch-cpu", "--schemes", "w4a16-g128-asym"], "divisible by 128"),  # d_model 32: shape mismatch
        (["--runtimes", "torch-cpu", "--tokens", "1,x"], "--tokens must be"),
    ],
    ids=["unknown-runtime", "unsupported-scheme", "unknown-scheme", "group-mismatch", "bad-tokens"],
)
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    rc = main(["bench", "--d-model", str(D), "--out", str(tmp_path), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "latency.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_unavailable_runtime_gives_its_reason(tmp_path, capsys):
    rc = main(["bench", "--runtimes", "torch-cuda", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "runtime torch-cuda is not available: no CUDA device" in err


def test_sweep_time_limit_lists_the_rest_as_not_run(spec):
    cfg = BenchConfig(tokens=(1,), budget_s=0.01, warmup=0, min_repeats=1, max_total_s=1e-9)
    result = run_benchmark([spec], [FakeRuntime()], ["fp32", "fp16"], cfg, timer_factory=_timers({"fp32": 0.001}),
                           environment=ENV)
    assert result.cases == []
    assert [s["scheme"] for s in result.skipped] == ["fp32", "fp16"]
    assert all("time limit" in s["reason"] for s in result.skipped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_skip_unavailable_reports_the_reason(tmp_path):
    rc = main(["bench", "--variants", "relu", "--d-model", str(D), "--runtimes", "torch-cuda,torch-cpu",
               "--skip-unavailable", "--schemes", "fp32,fp8-e4m3", "--tokens", "1", "--budget-s", "0.005",
               "--min-repeats", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "latency.json").read_text())
    rows = {r["name"]: r for r in doc["runtimes"]}
    assert rows["torch-cuda"]["available"] is False and "no CUDA device" in rows["torch-cuda"]["reason"]
    assert {c["runtime"] for c in doc["cases"]} == {"torch-cpu"}


# --- numerics against ffnquant's reference, and the GPU targets --------------------------------------
def test_reference_of_a_fake_runtime_that_runs_fp32_weights(spec):
    """A 'w8a16' runtime that silently runs fp32 weights disagrees with ffnquant's w8a16 reference."""
    cfg = BenchConfig(tokens=(1,), budget_s=0.001, warmup=0, min_repeats=1)
    result = run_benchmark([spec], [FakeRuntime()], ["fp32", "fp16", "w8a16"], cfg, timer_factory=lambda r, l: FakeTimer([1e-3]))
    fake = result.case("relu", "fake-cpu", "w8a16", 1)
    # the reference quantizes the weights to int8 (about 40 dB on this tiny FFN); the fake is exact
    assert fake.reference_sqnr_db is not None and fake.reference_sqnr_db < 60
    assert fake.sqnr_db is None or fake.sqnr_db > fake.reference_sqnr_db + 20
    assert fake.disagrees_with_reference is True
    # float formats are not flagged: their differences are fp16 rounding, not a recipe's numerics
    assert result.case("relu", "fake-cpu", "fp16", 1).disagrees_with_reference is None
    assert result.case("relu", "fake-cpu", "fp32", 1).reference_note == "fp32 is the reference itself"


def test_torch_cpu_kernels_against_the_reference(spec):
    """int8 weight-only on torch-cpu computes the preset's numerics: it agrees with the reference."""
    cfg = BenchConfig(tokens=(1,), budget_s=0.001, warmup=0, min_repeats=1)
    result = run_benchmark([spec], ["torch-cpu"], ["fp32", "w8a16", "bf16"], cfg)
    w8 = result.case("relu", "torch-cpu", "w8a16", 1)
    assert w8.disagrees_with_reference is False
    # same weights, same float math up to summation order: far closer to the reference than to fp32
    assert w8.sqnr_vs_reference_db > w8.sqnr_db + 30
    bf16 = result.case("relu", "torch-cpu", "bf16", 1)
    assert bf16.reference_sqnr_db is None and "bf16 is a runtime format" in bf16.reference_note
    assert result.case("relu", "torch-cpu", "fp32", 1).sqnr_vs_reference_db is None


def test_reference_check_can_be_switched_off(spec):
    cfg = BenchConfig(tokens=(1,), budget_s=0.001, warmup=0, min_repeats=1, reference_check=False)
    result = run_benchmark([spec], ["torch-cpu"], ["w8a16"], cfg)
    c = result.case("relu", "torch-cpu", "w8a16", 1)
    assert c.reference_sqnr_db is None and c.reference_note == "reference check off"


def _doc_case(runtime, scheme, tokens, median_s, variant="swiglu", **kw):
    return {"variant": variant, "spec_key": f"{variant}_d64", "runtime": runtime, "scheme": scheme,
            "tokens": tokens, "median_s": median_s, "error": None, "roofline_fraction": kw.get("roof"),
            "sqnr_db": kw.get("sqnr"), "max_abs_error": kw.get("max_err", 0.1),
            "reference_sqnr_db": kw.get("ref"), "sqnr_vs_reference_db": kw.get("vs_ref"),
            "disagrees_with_reference": kw.get("differs"), "reference_note": kw.get("note")}


def test_gpu_targets_compare_each_kernel_with_its_own_runtime():
    from ffnquant.bench import gpu_targets

    doc = {"config": {"tokens": [1, 2048]}, "wall_s": 300.0, "cases": [
        _doc_case("torch-cuda-graph", "fp16", 1, 60e-6),
        _doc_case("torch-cuda-graph", "w4a16-g128", 1, 30e-6, roof=0.4),
        _doc_case("triton-cuda", "fp16", 1, 58e-6),
        _doc_case("triton-cuda", "w4a16-g128", 1, 16e-6, roof=0.85),
        _doc_case("torch-cuda", "bf16", 2048, 1e-3),
        _doc_case("torch-cuda", "w8a8-dynamic", 2048, 0.8e-3),
        _doc_case("torch-cuda", "fp8-e4m3-dynamic", 2048, 0.6e-3),
        _doc_case("torch-cpu", "w4a16-g128", 1, 1e-6),  # not a GPU case: ignored
    ]}
    w4, w8, wall = gpu_targets(doc)
    assert w4["best"]["runtime"] == "triton-cuda" and w4["best"]["speedup"] == pytest.approx(58 / 16)
    assert w4["met"] is True and len(w4["kernels"]) == 2
    assert w8["best"]["scheme"] == "fp8-e4m3-dynamic" and w8["best"]["speedup"] == pytest.approx(1 / 0.6)
    assert w8["met"] is True and w8["tokens"] == 2048
    assert wall["met"] is True
    doc["wall_s"] = 400.0
    assert gpu_targets(doc)[2]["met"] is False
    assert gpu_targets({"config": {"tokens": [1]}, "cases": [_doc_case("torch-cpu", "fp32", 1, 1e-3)]}) == []


def test_numerics_table_puts_every_runtime_beside_the_reference():
    from ffnquant.bench import numerics_rows

    doc = {"config": {"tokens": [1], "budget_s": 0.1, "warmup": 1, "min_repeats": 1, "accuracy_tokens": 64},
           "runtimes": [{"name": n, "available": True, "reason": ""} for n in ("ort-cpu", "torch-cuda")],
           "specs": [], "environment": {}, "cases": [
               _doc_case("ort-cpu", "w4a16-g128", 1, 1e-3, sqnr=16.2, ref=16.2, vs_ref=130.0, differs=False, note="n"),
               _doc_case("torch-cuda", "w4a16-g128", 1, 1e-4, sqnr=16.9, ref=16.2, vs_ref=14.0, differs=True, note="n"),
               _doc_case("torch-cuda", "fp32", 1, 1e-4, sqnr=None, max_err=0.0, note="fp32 is the reference itself"),
           ]}
    rows = {r["scheme"]: r for r in numerics_rows(doc)}
    assert rows["w4a16-g128"]["runtimes"]["torch-cuda"]["disagrees"] is True
    assert rows["w4a16-g128"]["runtimes"]["ort-cpu"]["sqnr_vs_reference_db"] == 130.0
    assert math.isinf(rows["fp32"]["runtimes"]["torch-cuda"]["sqnr_db"])  # exact output, stored as None
    md = latency_markdown(doc)
    assert "## Numerics across runtimes" in md
    assert "| swiglu | w4a16-g128 | 16.2 | 16.2 / 130.0 | 16.9 / 14.0 **DIFFERS** |" in md
    assert "| swiglu | fp32 | - | - | exact |" in md


# --- timings not to trust (issue 27, item 6) --------------------------------------------------------
@pytest.mark.parametrize("timers, cfg, scheme, why", [
    pytest.param({"fp32": 0.02, "fp16": 0.001}, dict(budget_s=0.03, min_repeats=1), "fp32", "2 samples (fewer than 5)",
                 id="2-samples"),
    pytest.param({"fp32": 0.0202, "fp16": 0.000145}, dict(budget_s=100.0, min_repeats=5, max_repeats=5), "fp16",
                 "139x faster than fp32, beyond the roofline's 4x", id="139x-beyond-the-roofline"),
    pytest.param({"fp32": 0.001, "fp16": 0.05}, dict(budget_s=100.0, min_repeats=5, max_repeats=5), "fp16",
                 "50x slower than fp32, beyond the 8x a float format can differ by", id="float-50x-slower"),
])
def test_an_untrustworthy_timing_is_flagged_suspect_and_reported(spec, timers, cfg, scheme, why):
    result = run_benchmark([spec], [FakeRuntime()], ["fp16"], BenchConfig(tokens=(1,), warmup=0, **cfg),
                           timer_factory=_timers(timers), environment=ENV)
    case = result.case("relu", "fake-cpu", scheme, 1)
    assert case.suspect == why
    doc = result.to_dict()
    assert doc["cases"][[c.scheme for c in result.cases].index(scheme)]["suspect"] == why
    md = latency_markdown(doc)
    assert "**SUSPECT**" in md and f"- fake-cpu {scheme} (relu, M=1): {why}" in md


def test_a_trustworthy_timing_is_not_suspect(spec):
    result = run_benchmark([spec], [FakeRuntime()], ["fp16"],
                           BenchConfig(tokens=(1,), warmup=0, budget_s=100.0, min_repeats=5, max_repeats=5),
                           timer_factory=_timers({"fp32": 0.002, "fp16": 0.001}), environment=ENV)
    assert [c.suspect for c in result.cases] == [None, None]
    assert "SUSPECT" not in latency_markdown(result.to_dict())


def test_the_latency_report_states_the_load_average_before_and_after(spec, monkeypatch):
    loads = iter([(3.5, 2.0, 1.0), (7.25, 3.0, 1.5)])
    monkeypatch.setattr("ffnquant.bench.os.getloadavg", lambda: next(loads))
    result = run_benchmark([spec], [FakeRuntime()], ["fp32"], BenchConfig(tokens=(1,), warmup=0, min_repeats=5),
                           timer_factory=_timers({"fp32": 0.002}), environment=ENV)
    assert result.environment["load_average"] == {"before": [3.5, 2.0, 1.0], "after": [7.25, 3.0, 1.5]}
    assert "- Load average (1/5/15 min) before [3.5, 2.0, 1.0], after [7.25, 3.0, 1.5]" in latency_markdown(result.to_dict())
