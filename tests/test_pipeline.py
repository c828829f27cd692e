"""The run's stages (ffnquant.pipeline): byte accounting, honest latency labels, config errors."""

from __future__ import annotations

import importlib.util

import pytest

from ffnquant import FFNSpec
from ffnquant.errors import FFNQuantError
from ffnquant.pipeline import RunConfig, load_config, run
from ffnquant.report import validate_report
from ffnquant.schemes import weight_bytes
from ffnquant.recipe import Recipe


@pytest.mark.parametrize("variant", ["relu", "swiglu"], ids=str)
@pytest.mark.parametrize(
    "scheme, d_model",
    [("w4a16-g32", 64), ("w4a16-g32-asym", 64), ("nf4", 64),
     # widths the group does not divide: the artifact stores padded groups (nf4: a partial last block)
     ("w4a16-g64", 96), ("w4a16-g64-asym", 96), ("w4a16-g128", 96), ("nf4", 96)],
    ids=lambda v: str(v),
)
def test_weight_bytes_equal_the_artifacts_initializers(variant, scheme, d_model, tmp_path):
    """The size column is what the 4-bit artifact stores: packed codes, float32 group scales, packed zero
    points, fp32 biases (it used to count the scales as 2-byte floats); padded groups count as stored."""
    from ffnquant.quantization import quantize_spec
    from ffnquant.runtimes.artifacts import onnx_weight_bytes

    spec = FFNSpec(variant, d_model=d_model)
    res = quantize_spec(spec, Recipe(scheme), source="gaussian", calib_tokens=256, eval_tokens=64,
                        out_artifacts=tmp_path, sensitivity=False, baseline=False)
    assert weight_bytes(spec, Recipe(scheme).resolve()) == onnx_weight_bytes(res.artifact["path"])


def test_remedy_recipes_are_not_timed_on_a_plain_artifact(tmp_path):
    """With onnx = false there is no artifact of `w8a8+smooth+rotate`: the harness would build a plain
    w8a8 one (no Hadamard MatMul) and the report would label its time with the recipe. It is skipped, saying why."""
    pytest.importorskip("onnxruntime")
    cfg = RunConfig.tiny(variants=("swiglu",), schemes=("fp32", "w8a8", "w8a8+smooth+rotate"), runtimes=("ort-cpu",),
                         tokens=(1,), onnx=False, sensitivity=False, out_reports=str(tmp_path / "r"),
                         out_export=str(tmp_path / "e"))
    lat = run(cfg).document["timing"]["latency"]
    timed = {c["scheme"] for c in lat["cases"] if c["error"] is None}
    assert "w8a8" in timed and "w8a8+smooth+rotate" not in timed
    assert any(s.get("scheme") == "w8a8+smooth+rotate" and "no ONNX artifact" in s["reason"] for s in lat["skipped"])


def test_remedy_recipes_are_timed_on_their_own_artifact(tmp_path):
    pytest.importorskip("onnxruntime")
    cfg = RunConfig.tiny(variants=("swiglu",), schemes=("fp32", "w8a8+smooth+rotate"), runtimes=("ort-cpu",),
                         tokens=(1,), sensitivity=False, out_reports=str(tmp_path / "r"), out_export=str(tmp_path / "e"))
    doc = run(cfg).document
    case = next(c for c in doc["timing"]["latency"]["cases"] if c["scheme"] == "w8a8+smooth+rotate")
    assert case["error"] is None
    art = next(a for a in doc["artifacts"] if a["scheme"] == "w8a8+smooth+rotate")
    assert art["path"].endswith(f".{Recipe.parse('w8a8+smooth+rotate').slug}.onnx")


def test_load_config_does_not_reword_a_programming_error(tmp_path, monkeypatch):
    """A TypeError inside ffnquant is a bug to report, not a user's bad config file."""
    path = tmp_path / "run.toml"
    path.write_text(RunConfig.tiny().to_toml())

    def broken(cls, data):
        raise TypeError("internal bug")

    monkeypatch.setattr(RunConfig, "from_dict", classmethod(broken))
    with pytest.raises(TypeError, match="internal bug"):
        load_config(path)


def test_config_keeps_recipes_and_writes_their_text():
    cfg = RunConfig.tiny(schemes=("fp32", Recipe("w8a8", "auto", 0.5)))
    assert cfg.recipes == (Recipe("fp32"), Recipe("w8a8", "auto", 0.5))
    assert cfg.to_dict()["schemes"] == ["fp32", "w8a8@auto+smooth"]
    with pytest.raises(FFNQuantError, match="schemes lists a scheme twice"):
        RunConfig.tiny(schemes=("fp32", "w8a8", Recipe("w8a8")))


@pytest.mark.parametrize("p90_ms, choice", [(1.05, "fp32"), (0.85, "w8a8")], ids=["within-spread", "beyond-spread"])
def test_recommendations_use_the_cases_spread(p90_ms, choice):
    """The run hands each case's p10/p90 to the recommender: a lower median inside the baseline's
    spread is no speedup (it used to read them from a key the cases do not have, and compared medians)."""
    from ffnquant.pipeline.findings import recommendations
    from ffnquant.measure.recommend import join_points

    cfg = RunConfig.tiny(schemes=("fp32", "w8a8"), runtimes=("none",))
    case = dict(variant="relu", runtime="ort-cpu", tokens=1, error=None)
    cases = [dict(case, scheme="fp32", median_s=1e-3, p10_s=0.9e-3, p90_s=1.1e-3),
             dict(case, scheme="w8a8", median_s=0.8e-3, p10_s=0.7e-3, p90_s=p90_ms * 1e-3)]
    rows = [{"variant": "relu", "scheme": "w8a8", "status": "ok", "sqnr_db": 40.0, "label": "w8a8"}]
    recs, _ = recommendations(join_points(cases, rows, cfg.baseline), target_db=cfg.target_db, baseline=cfg.baseline)
    assert [r["choice"] for r in recs] == [choice]


@pytest.mark.parametrize("suspect, choice", [(None, "w8a8"), ("139x faster than fp32, beyond the roofline's 4x", "fp32")],
                         ids=["trusted", "suspect"])
def test_recommendations_leave_out_suspect_cases(suspect, choice):
    """A case the bench flagged (too few samples, a ratio beyond the roofline) is never recommended."""
    from ffnquant.pipeline.findings import recommendations
    from ffnquant.measure.recommend import join_points

    cfg = RunConfig.tiny(schemes=("fp32", "w8a8"), runtimes=("none",))
    case = dict(variant="relu", runtime="ort-cpu", tokens=1, error=None)
    cases = [dict(case, scheme="fp32", median_s=1e-3, p10_s=0.9e-3, p90_s=1.1e-3, suspect=None),
             dict(case, scheme="w8a8", median_s=0.5e-3, p10_s=0.45e-3, p90_s=0.55e-3, suspect=suspect)]
    rows = [{"variant": "relu", "scheme": "w8a8", "status": "ok", "sqnr_db": 40.0, "label": "w8a8"}]
    recs, _ = recommendations(join_points(cases, rows, cfg.baseline), target_db=cfg.target_db, baseline=cfg.baseline)
    assert [r["choice"] for r in recs] == [choice]


def test_the_plot_shows_the_sqnr_the_recommendation_used(monkeypatch, tmp_path):
    """A runtime that computes something other than the recipe (a saturating int8 kernel) is recommended at its
    own SQNR; the report's accuracy-vs-latency plot re-joined the cases with the recipe's figure instead."""
    from ffnquant.pipeline import latency as L
    from ffnquant.report.view import _points

    def fake_latency(*args, **kwargs):
        case = dict(variant="relu", runtime="ort-cpu", tokens=1, error=None, disagrees_with_reference=None, sqnr_db=None)
        return {"status": "ok", "reason": None, "primary_tokens": 1, "skipped": [],
                "runtimes": [{"name": "ort-cpu", "available": True, "reason": "ok", "device": "cpu", "error": None}],
                "cases": [dict(case, scheme="fp32", median_s=1e-3, p10_s=0.9e-3, p90_s=1.1e-3),
                          dict(case, scheme="w8a8", median_s=0.4e-3, p10_s=0.35e-3, p90_s=0.45e-3,
                               disagrees_with_reference=True, sqnr_db=30.5)]}

    monkeypatch.setattr(L, "measure_latency", fake_latency)
    cfg = RunConfig.tiny(variants=("relu",), schemes=("fp32", "w8a8"), runtimes=("none",), tokens=(1,), onnx=False,
                         sensitivity=False, out_reports=str(tmp_path / "r"), out_export=str(tmp_path / "e"))
    doc = run(cfg).document
    recipe_db = next(r["sqnr_db"] for r in doc["accuracy"]["rows"] if r["scheme"] == "w8a8")
    assert recipe_db != pytest.approx(30.5)
    rec = next(r for r in doc["timing"]["recommendations"] if r["runtime"] == "ort-cpu")
    assert (rec["choice"], rec["sqnr_db"]) == ("w8a8", 30.5)
    plotted = {p.scheme: p.sqnr_db for p in _points(doc, "ort-cpu", 1, "relu")}
    assert plotted == {"fp32": None, "w8a8": rec["sqnr_db"]}
    if importlib.util.find_spec("jsonschema") is not None:
        validate_report(doc)  # the stored points are in the schema


@pytest.mark.parametrize("repeats, act_s, status", [
    pytest.param(7, [1e-6] * 8, "confirmed", id="quiet-confirmed"),
    pytest.param(7, [1e-6] * 4 + [50e-6] * 4, "not measured", id="spread-straddles"),
    pytest.param(2, [1e-6] * 3, "not measured", id="2-samples"),
    pytest.param(7, [50e-6] * 8, "contradicted", id="quiet-contradicted"),
])
def test_the_activation_time_claim_ignores_timings_not_to_trust(monkeypatch, repeats, act_s, status):
    """The seed claim flipped to CONTRADICTED on a loaded machine: its verdict now needs timings beyond their
    spread and enough samples, else it is 'not measured'."""
    import itertools

    import torch

    from ffnquant import build
    from ffnquant.pipeline import findings as F
    from ffnquant.spec import FFNSpec

    model = build(FFNSpec("relu", d_model=16), seed=0)
    # perf_counter read twice per timed call: the activation's calls, then the whole forward's (1 ms each)
    clock = itertools.accumulate(itertools.chain(itertools.chain.from_iterable(
        (0.0, d) for d in act_s[:repeats] + [1e-3] * repeats), itertools.repeat(0.0)))
    monkeypatch.setattr(F.time, "perf_counter", lambda: next(clock))
    claim = F.activation_time_claim(model, torch.zeros(4, 16), repeats=repeats)
    assert claim["status"] == status, claim


# --- the default run recommends at every token count ---------------------------------------------------------
def _slow_runtime(seconds: float):
    """A runtime whose every call takes `seconds` of wall time: slower than the default budget allows two of."""
    import time

    import torch

    from ffnquant.runtimes.base import Availability, Loaded, Runtime, check_input

    class SlowRuntime(Runtime):
        name, device, baseline = "slow-cpu", "cpu", "fp32"

        def __init__(self):
            self.calls = 0

        def _check_availability(self):
            return Availability(True, "fake", "cpu")

        @property
        def formats(self):
            return ("fp32", "fp16")

        def load(self, case):
            self.check(case)
            return Loaded(self.name, case, case.float_model(), "cpu", f"slow {case.scheme}", 1000, "float32", "float32")

        def prepare(self, loaded, x):
            return torch.from_numpy(check_input(x, loaded.spec))

        def run(self, loaded, prepared):
            self.calls += 1
            time.sleep(seconds)
            with torch.no_grad():
                return loaded.handle(prepared)

        def to_numpy(self, loaded, output):
            return output.numpy()

    return SlowRuntime()


def test_a_slow_case_gets_the_samples_a_recommendation_needs_under_the_default_budget():
    """At M=512 one call took longer than half the default budget: the budget was a cap and every case stopped
    at two samples, too few to trust. The budget is a target: each case still gets MIN_TIMED_SAMPLES."""
    from ffnquant.measure.latency import MIN_TIMED_SAMPLES
    from ffnquant.pipeline.latency import LatencySettings, measure_latency

    budget = RunConfig().budget_s
    per_call = budget * 0.6  # two calls spend the budget
    rt = _slow_runtime(per_call)
    settings = LatencySettings(runtimes=("slow-cpu",), tokens=(4,), budget_s=budget, seed=0)
    section = measure_latency(settings, [FFNSpec("relu", d_model=16)], [Recipe.parse("fp32"), Recipe.parse("fp16")],
                              {}, {}, [("slow-cpu", rt.availability(), rt)], [], None)
    cases = section["cases"]
    assert [c["error"] for c in cases] == [None, None]
    assert [c["n"] for c in cases] == [MIN_TIMED_SAMPLES] * 2
    assert all(c["suspect"] is None or "fewer than" not in c["suspect"] for c in cases)


def test_the_terminal_names_a_recommendation_at_each_token_count_or_says_why_not():
    from ffnquant.commands.run import recommendation_lines

    cfg = RunConfig.tiny(variants=("relu",), tokens=(1, 512), runtimes=("none",))
    rec = dict(variant="relu", runtime="ort-cpu", choice="w8a8", label="w8a8 (2.0x)", reason="w8a8: 35 dB")
    suspect = dict(rec, choice="fp32", label="fp32 (timing suspect)",
                   reason="fp32: the timings on ort-cpu at M=512 are suspect (fp32: 2 samples (fewer than 5))")
    lines = recommendation_lines([dict(rec, tokens=1), dict(suspect, tokens=512)], cfg, {"status": "ok"})
    table = "\n".join(lines[:2])
    assert "M=1" in table and "M=512" in table and "w8a8 (2.0x)" in table and "fp32 (timing suspect)" in table
    assert ("M=512: no recommendation for 1 of 1 variant/runtime pairs: relu on ort-cpu: fp32: the timings on "
            "ort-cpu at M=512 are suspect (fp32: 2 samples (fewer than 5))") in lines
    assert not any(line.startswith("M=1:") for line in lines)
    assert recommendation_lines([], cfg, {"status": "missing", "reason": "no runtimes requested"}) == [
        "No recommendation at any M: no runtimes requested"]
