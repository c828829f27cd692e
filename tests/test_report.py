"""The report renderer on a synthetic document: schema, files, atomicity, determinism helpers."""

from __future__ import annotations

import base64
import copy
import json
import re

import pytest

from ffnquant.errors import FFNQuantError
from ffnquant.report import (
    PLOT_DIR,
    render_html,
    render_markdown,
    render_plots,
    report_schema,
    strip_timing,
    validate_report,
    write_report,
)
from ffnquant.spec import FFNSpec

jsonschema = pytest.importorskip("jsonschema")


def _stats(crest, kurt, zero=0.0):
    return {"min": -1.0, "max": crest, "absmax": crest, "mean": 0.0, "std": 1.0, "crest_factor": crest,
            "kurtosis": kurt, "zero_fraction": zero}


def synthetic_doc() -> dict:
    """A small but complete document with hand-picked numbers (2 variants, 3 schemes, 1 runtime, 2 shapes)."""
    specs = [FFNSpec("relu", d_model=64), FFNSpec("swiglu", d_model=64)]
    spec_rows = [dict(s.to_dict(), key=s.key, n_params=s.n_params, flops_per_token=s.flops_per_token) for s in specs]
    hist = {"edges": [-4.0, -2.0, 0.0, 2.0, 4.0], "counts": [0, 0, 50, 3]}
    lat = {("relu", "fp32"): 1.0e-3, ("relu", "w8a8"): 0.4e-3, ("relu", "w4a16-g128"): 1.2e-3,
           ("swiglu", "fp32"): 1.1e-3, ("swiglu", "w8a8"): 0.45e-3, ("swiglu", "w4a16-g128"): 1.3e-3}
    sqnr = {("relu", "w8a8"): 33.0, ("relu", "w4a16-g128"): 19.0, ("swiglu", "w8a8"): 26.0, ("swiglu", "w4a16-g128"): 18.5}
    cases = []
    for (v, s), t in lat.items():
        for m, scale in ((1, 0.05), (512, 1.0)):
            cases.append({"variant": v, "scheme": s, "runtime": "ort-cpu", "tokens": m, "median_s": t * scale,
                          "p10_s": t * scale, "p90_s": t * scale, "p99_s": t * scale, "mean_s": t * scale, "std_s": 0.0,
                          "n": 10, "tokens_per_s": m / (t * scale), "roofline_fraction": None,
                          "slower_than_baseline": s == "w4a16-g128", "speedup": lat[(v, "fp32")] / t, "error": None})
    cases.append({"variant": "relu", "scheme": "nf4", "runtime": "bnb", "tokens": 1, "median_s": None, "error": "boom"})
    rows = []
    for v in ("relu", "swiglu"):
        rows.append({"variant": v, "scheme": "fp32", "label": "fp32", "status": "ok", "reason": None, "sqnr_db": None,
                     "cosine": 1.0, "rel_l2": 0.0, "max_abs_error": 0.0, "size_bytes": 4 * specs[0].n_params,
                     "onnx_sqnr_db": None, "sensitivity": None})
        for s in ("w8a8", "w4a16-g128"):
            rows.append({"variant": v, "scheme": s, "label": f"{s} (mse)" if s == "w8a8" else s, "status": "ok",
                         "reason": None, "sqnr_db": sqnr[(v, s)], "cosine": 0.999, "rel_l2": 0.02,
                         "max_abs_error": 0.1, "size_bytes": 1000, "onnx_sqnr_db": sqnr[(v, s)] - 0.1,
                         "sensitivity": {"input": 40.0, "hidden": sqnr[(v, s)] + 0.5} if s == "w8a8" else None})
    rows.append({"variant": "relu", "scheme": "w8a8+smooth", "label": "w8a8+smooth", "status": "not applicable",
                 "reason": "not exact for gelu", "sqnr_db": None, "cosine": None, "max_abs_error": None, "size_bytes": None})
    return {
        "schema": "ffnquant-report", "schema_version": 1, "ffnquant_version": "0.1.0",
        "command": "ffnquant run --tiny",
        "config": {"schemes": ["fp32", "w8a8", "w4a16-g128"], "target_db": 30.0, "baseline": "fp32", "d_model": 64, "seed": 0},
        "environment": {"timestamp_utc": "2026-01-01T00:00:00+00:00", "platform": "Linux", "python": "3.11",
                        "packages": {"torch": "2.13.0"}, "cpu": "test cpu", "cpu_count": 2},
        "specs": spec_rows,
        "data": {"source": "llm_like(seed=0)", "calib_tokens": 256, "eval_tokens": 128, "separation": "streams 0/1"},
        "ranges": {"status": "ok", "reason": None, "markdown": "### range details\n\nsome | text",
                   "variants": {"relu": {"sites": {"hidden": _stats(9.0, 6.0, 0.5), "input": _stats(4.0, 3.0)},
                                         "hidden_histogram": hist, "n_tokens": 256},
                                "swiglu": {"sites": {"hidden": _stats(22.0, 20.0), "input": _stats(4.0, 3.0)},
                                           "hidden_histogram": hist, "n_tokens": 256}},
                   "findings": ["swiglu has the widest hidden range"]},
        "claims": [{"claim": "about half of ReLU hidden units are zero", "status": "confirmed", "figure": "50.0%"},
                   {"claim": "SwiGLU widest", "status": "contradicted", "figure": "crest 9 vs 22"}],
        "accuracy": {"status": "ok", "reason": None, "rows": rows, "baseline": None},
        "artifacts": [{"variant": "relu", "scheme": "w8a8", "path": "export/relu.w8a8.onnx", "size_bytes": 1234}],
        "findings": [{"text": "swiglu's hidden is 2.4x wider than relu's; it costs 7.0 dB at w8a8"}],
        "missing": [{"part": "nf4", "reason": "bitsandbytes missing"}],
        "timing": {
            "wall_s": 12.5, "stages": {"profile": 1.0, "latency": 5.0},
            "latency": {"status": "partial", "reason": "bnb failed", "primary_tokens": 512,
                        "runtimes": [{"name": "ort-cpu", "available": True, "reason": "ok", "error": None, "device": "cpu"},
                                     {"name": "bnb", "available": True, "reason": "ok", "error": "boom", "device": "cpu"}],
                        "cases": cases},
            "recommendations": [
                {"variant": "relu", "runtime": "ort-cpu", "tokens": 512, "choice": "w8a8", "label": "w8a8 (mse)",
                 "reason": "w8a8 (mse): 33.0 dB >= 30 dB target, 2.5x faster than fp32 on ort-cpu at M=512",
                 "meets_target": True, "target_db": 30.0, "speedup": 2.5},
                {"variant": "swiglu", "runtime": "ort-cpu", "tokens": 512, "choice": "fp32", "label": "fp32",
                 "reason": "fp32: no quantized scheme meeting 30 dB is faster", "meets_target": True, "target_db": 30.0,
                 "speedup": 1.0}],
            "pareto": [{"variant": "relu", "runtime": "ort-cpu", "tokens": 512, "schemes": ["w8a8", "fp32"]}],
            "claims": [{"claim": "activation is at most 1% of FFN time", "status": "contradicted", "figure": "3.1%"}],
        },
    }


def test_schema_is_valid_and_accepts_the_document():
    jsonschema.Draft202012Validator.check_schema(report_schema())
    validate_report(synthetic_doc())


@pytest.mark.parametrize("mutate, where", [
    pytest.param(lambda d: d.pop("accuracy"), "(top level)", id="missing-section"),
    pytest.param(lambda d: d["claims"][0].update(status="maybe"), "claims/0/status", id="bad-claim-status"),
    pytest.param(lambda d: d["timing"]["latency"]["cases"][0].update(tokens=0), "timing/latency/cases/0/tokens", id="bad-tokens"),
    pytest.param(lambda d: d.update(schema_version=2), "schema_version", id="wrong-version"),
])
def test_schema_rejects_broken_documents(mutate, where):
    doc = synthetic_doc()
    mutate(doc)
    with pytest.raises(FFNQuantError, match=re.escape(where)):
        validate_report(doc)


def test_strip_timing_removes_only_clock_dependent_parts():
    a, b = synthetic_doc(), synthetic_doc()
    b["timing"]["wall_s"] = 99.0
    b["timing"]["latency"]["cases"][0]["median_s"] = 5.0
    b["environment"]["timestamp_utc"] = "2030-01-01T00:00:00+00:00"
    assert a != b and strip_timing(a) == strip_timing(b)
    b["accuracy"]["rows"][1]["sqnr_db"] = 1.0
    assert strip_timing(a) != strip_timing(b)
    assert "timing" in a and "timestamp_utc" in a["environment"]  # the input is not modified


def test_markdown_has_every_section_and_the_numbers():
    doc = synthetic_doc()
    plots = render_plots(doc)
    assert set(plots) == {"hidden_hist.png", "crest_kurtosis.png", "scatter_ort_cpu.png", "latency_tokens_ort_cpu.png"}
    assert all(p.startswith(b"\x89PNG") for p in plots.values())
    md = render_markdown(doc, plots)
    assert md.startswith("# ffnquant report") and "Made by: `ffnquant run --tiny`" in md
    for heading in ("## Recommendations", "## Activation ranges per site", "## The seeds' claims, checked",
                    "## Accuracy on held-out data", "### Where the error comes from", "## Latency", "### ort-cpu",
                    "## Artifacts", "## Environment"):
        assert heading in md, heading
    assert "w8a8 (mse): 33.0 dB >= 30 dB target" in md
    assert "**slower**" in md  # w4a16 flagged
    assert "CONTRADICTED" in md and "3.1%" in md
    assert "bnb relu nf4 M=1: boom" in md
    assert "- nf4: bitsandbytes missing" in md
    for name in plots:
        assert f"]({PLOT_DIR}/{name})" in md


def test_html_is_self_contained():
    doc = synthetic_doc()
    plots = render_plots(doc)
    page = render_html(render_markdown(doc, plots), plots)
    assert "<table>" in page and "<style>" in page
    srcs = re.findall(r'src="([^"]+)"', page)
    assert len(srcs) == len(plots) and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert base64.b64decode(srcs[0].split(",", 1)[1]).startswith(b"\x89PNG")
    assert "http://" not in page and "https://" not in page  # nothing to fetch


def test_write_report_writes_every_file(tmp_path):
    doc = synthetic_doc()
    paths = write_report(doc, tmp_path / "r")
    assert {"json", "md", "html"} <= set(paths)
    assert json.loads(paths["json"].read_text()) == doc
    assert sorted(p.name for p in (tmp_path / "r" / PLOT_DIR).iterdir()) == sorted(
        k.split(":", 1)[1] for k in paths if k.startswith("plot:"))
    assert not [p for p in (tmp_path / "r").rglob(".*.tmp")]


def test_write_report_fails_before_writing(tmp_path):
    doc = synthetic_doc()
    doc["timing"]["wall_s"] = float("nan")  # not valid JSON
    with pytest.raises(FFNQuantError, match="not valid JSON"):
        write_report(doc, tmp_path / "r")
    assert not (tmp_path / "r").exists()
    doc = synthetic_doc()
    del doc["specs"]  # renderer fails midway
    with pytest.raises(KeyError):
        write_report(doc, tmp_path / "r2")
    assert not (tmp_path / "r2").exists()


def test_plots_are_deterministic():
    doc = synthetic_doc()
    assert render_plots(doc) == render_plots(copy.deepcopy(doc))


@pytest.mark.skipif(__import__("shutil").which("chromium") is None, reason="Debian's chromium is not installed")
def test_html_renders_in_a_headless_browser(tmp_path):
    """The page loads from file:// with no network and renders its tables and plots (the screenshot has content)."""
    import subprocess

    from PIL import Image

    paths = write_report(synthetic_doc(), tmp_path / "r")
    shot = tmp_path / "shot.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,3000",
           paths["html"].resolve().as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert shot.exists(), "chromium wrote no screenshot"
    image = Image.open(shot).convert("L")
    # Plots and tables put many distinct grey levels on the page; a blank or broken page has a handful.
    assert len(image.getcolors(maxcolors=256) or range(256)) > 50


def test_report_files_get_ordinary_permissions(tmp_path):
    """Atomic writes go through mkstemp (0600); the finished files must be readable like any other."""
    import os

    old = os.umask(0o022)
    try:
        paths = write_report(synthetic_doc(), tmp_path / "r")
    finally:
        os.umask(old)
    for p in (paths["json"], paths["md"], paths["html"]):
        assert os.stat(p).st_mode & 0o777 == 0o644, p


# --- the deployment report: the plain verdict on the plan's target first (issue 27) ------------------

@pytest.mark.parametrize("figures, proof, expected", [
    pytest.param({"perplexity_ratio": 1.0131, "perplexity_ratio_ci": [1.0101, 1.0160]}, True,
                 "the deployed model (loaded back) misses the plan's target (ppl+1%): +1.31%", id="loaded-misses"),
    pytest.param({"perplexity_ratio": 1.0042, "perplexity_ratio_ci": [1.0011, 1.0080]}, True,
                 "the deployed model (loaded back) meets the plan's target (ppl+1%): +0.42%", id="loaded-meets"),
    pytest.param({"perplexity_ratio": 1.0090, "perplexity_ratio_ci": [1.0050, 1.0130]}, True,
                 "misses (at its 95% confidence bound; the point estimate meets it) the plan's target", id="unresolved"),
    pytest.param({"perplexity_ratio": 1.0042, "perplexity_ratio_ci": None}, False,
                 "the deployed model (ffnquant's reference of it) meets the plan's target (ppl+1%): +0.42%",
                 id="onnx-reference"),
])
def test_deploy_verdict_says_whether_the_plan_target_is_met(figures, proof, expected):
    from ffnquant.report.deploy import target_verdict

    doc = {"plan": {"target": "ppl+1%"}, "reference": figures if not proof else {"perplexity_ratio": 1.0},
           **({"proof": {"load": figures}} if proof else {})}
    assert expected in target_verdict(doc)


def test_deploy_verdict_is_absent_without_a_target():
    from ffnquant.report.deploy import target_verdict

    assert target_verdict({"plan": {}, "reference": {"perplexity_ratio": 1.2}}) is None
