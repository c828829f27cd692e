"""The main job on a tiny size: every file, schema-valid JSON, determinism, config round trip, bad input."""

from __future__ import annotations

import os

import json
from pathlib import Path

import numpy as np
import pytest

from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.report import PLOT_DIR, strip_timing, validate_report
from ffnquant.pipeline import DEFAULT_SCHEMES, RunConfig, load_config, run
from ffnquant.recipe import Recipe, parse_recipe
from onnx_checks import graph_db

# Small enough for the suite: two variants, d_model 64, a few hundred tokens, tiny latency budget.
SMALL = dict(variants=("relu", "swiglu"), schemes=("fp32", "w8a8@auto", "w8a8-dynamic", "w4a16-g32"),
             tokens=(1, 32), budget_s=0.002, calib_tokens=256, eval_tokens=128, sensitivity=False,
             runtimes=("none",), onnx=False)


@pytest.fixture(scope="module")
def tiny_cli_run(tmp_path_factory):
    """`ffnquant run --tiny` through the CLI, once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    out, exp = root / "reports", root / "export"
    code = main(["run", "--tiny", "--out", str(out), "--export", str(exp)])
    return code, out, exp


def test_tiny_run_writes_every_file(tiny_cli_run):
    code, out, exp = tiny_cli_run
    assert code == 0
    doc = json.loads((out / "report.json").read_text())
    validate_report(doc)
    for name in ("report.md", "report.html", "run.toml"):
        assert (out / name).stat().st_size > 0, name
    plots = sorted(p.name for p in (out / PLOT_DIR).iterdir())
    assert {"hidden_hist.png", "crest_kurtosis.png"} <= set(plots)
    assert [s["variant"] for s in doc["specs"]] == ["relu", "gelu", "swiglu"]
    # paths outside the working folder are printed as folder/name, never this machine's absolute layout
    assert doc["command"] == f"ffnquant run --tiny --out {out.parent.name}/{out.name} --export {exp.parent.name}/{exp.name}"
    # fp32 ONNX of every variant in the artifact folder, recorded with its size
    for v in ("relu", "gelu", "swiglu"):
        assert list(exp.glob(f"{v}_d64_*.fp32.onnx")), v
    assert all(a["size_bytes"] > 0 for a in doc["artifacts"])
    # the accuracy table covers every variant x scheme; GELU's hidden is not smoothed (not exact) and it says so
    rows = {(r["variant"], r["scheme"]): r for r in doc["accuracy"]["rows"]}
    assert len(rows) == 3 * len(doc["config"]["schemes"])
    assert all(r["status"] == "ok" for r in rows.values()), [r["reason"] for r in rows.values() if r["status"] != "ok"]
    assert "hidden not smoothed" in rows[("gelu", "w8a8@auto+smooth")]["remedies"][0]["note"]
    assert rows[("swiglu", "w8a8-dynamic-s8")]["sqnr_db"] > rows[("swiglu", "w4a16-g32")]["sqnr_db"]
    # the exported artifacts agree with the torch reference (same scheme) within 0.5 dB
    for r in rows.values():
        if r["onnx_sqnr_db"] is not None:
            assert abs(graph_db(r) - r["sqnr_db"]) < 0.5, r  # the graph's figure where this CPU's kernel saturates
    # onnxruntime's default quantize_static is reported next to ours
    assert doc["accuracy"]["baseline"]["text"]
    # the run's own config file repeats the run
    assert load_config(out / "run.toml") == RunConfig.tiny(out_reports=str(out), out_export=str(exp))
    assert not list(out.rglob(".*.tmp"))


def test_tiny_run_html_is_self_contained(tiny_cli_run):
    _, out, _ = tiny_cli_run
    page = (out / "report.html").read_text()
    assert "report_plots/" not in page and page.count("data:image/png;base64,") >= 2


def test_recommendations_follow_from_the_measured_numbers(tiny_cli_run):
    """The pick is the fastest scheme that meets the target AND beats the baseline beyond the spread.

    A scheme with a lower median whose p90 is not below the baseline's p10 is no evidence of a
    speed-up (recommend.beats), so it does not compete with the pick.
    """
    _, out, _ = tiny_cli_run
    doc = json.loads((out / "report.json").read_text())
    lat = doc["timing"]["latency"]
    if lat["status"] == "missing":
        pytest.skip(f"latency not measured here: {lat['reason']}")
    acc = {(r["variant"], r["scheme"]): r["sqnr_db"] for r in doc["accuracy"]["rows"]}
    cases = {(c["variant"], c["runtime"], c["tokens"], c["scheme"]): c for c in lat["cases"] if not c["error"]}

    def delivered(case):  # a kernel that disagrees with its recipe (a saturating int8 kernel) counts at its own figure
        if case["disagrees_with_reference"] and case["sqnr_db"] is not None:
            return case["sqnr_db"]
        return acc.get((case["variant"], case["scheme"]))

    assert doc["timing"]["recommendations"]
    for rec in doc["timing"]["recommendations"]:
        if not rec["meets_target"] or rec["choice"] == "fp32":
            continue
        where = (rec["variant"], rec["runtime"], rec["tokens"])
        base = cases[(*where, rec["baseline"])]
        mine = cases[(*where, rec["choice"])]
        assert delivered(mine) >= rec["target_db"]
        assert (mine["p90_s"] or mine["median_s"]) < (base["p10_s"] or base["median_s"])
        for (v, rt, t, s), case in cases.items():
            beats_base = (case["p90_s"] or case["median_s"]) < (base["p10_s"] or base["median_s"])
            if (v, rt, t) == where and s != rec["baseline"] and delivered(case) is not None \
                    and delivered(case) >= rec["target_db"] and beats_base:
                assert mine["median_s"] <= case["median_s"], (rec, s)


def test_same_seed_same_json_apart_from_timings(tmp_path):
    cfg = RunConfig(**SMALL, out_reports=str(tmp_path / "r"), out_export=str(tmp_path / "e"))
    first = run(cfg).document
    second = run(cfg).document
    validate_report(first)
    assert strip_timing(first) == strip_timing(second)
    assert json.loads((tmp_path / "r" / "report.json").read_text()) == second


def test_config_round_trips_through_toml(tmp_path):
    cfg = RunConfig(variants=("swiglu", "relu"), d_model=128, schemes=("fp32", "w8a8@mse+smooth=0.8", "nf4"),
                    target_db=25.0, tokens=(16, 1), runtimes=("ort-cpu",), bias=False)
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    back = load_config(path)
    assert back == cfg and back.tokens == (1, 16) and str(back.schemes[1]) == "w8a8@mse+smooth=0.8"
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_cli_options_override_the_config_file(tmp_path):
    from ffnquant.cli import build_parser
    from ffnquant.commands.run import config_from_args

    path = tmp_path / "c.toml"
    path.write_text(RunConfig.tiny(target_db=20.0).to_toml())
    args = build_parser().parse_args(["run", "--config", str(path), "--target-db", "33", "--variants", "geglu"])
    cfg = config_from_args(args)
    assert cfg.target_db == 33.0 and cfg.variants == ("geglu",) and cfg.d_model == 64


@pytest.mark.parametrize("text, recipe", [
    ("w8a8", Recipe("w8a8")),
    ("W8A8@MSE", Recipe("w8a8", "mse")),
    ("w8a8@auto+smooth", Recipe("w8a8", "auto", 0.5)),
    ("w8a8+smooth=0.8+rotate", Recipe("w8a8", None, 0.8, True)),
], ids=str)
def test_parse_recipe(text, recipe):
    assert parse_recipe(text) == recipe
    assert parse_recipe(recipe.name) == recipe


@pytest.mark.parametrize("text, message", [
    pytest.param("w8a8@", "'@' must be followed by a calibrator; valid: minmax,", id="empty-calibrator"),
    pytest.param("w8a8+smooth+smooth=0.3", "remedy 'smooth' is given twice", id="smooth-twice"),
    pytest.param("w8a8+rotate+rotate", "remedy 'rotate' is given twice", id="rotate-twice"),
    pytest.param("@auto", "no scheme name before '@' or '+'", id="no-scheme"),
    pytest.param("w8a8+", "unknown remedy", id="empty-remedy"),
    pytest.param("w8a8+smooth=1.5", "smooth strength must be in [0, 1]", id="alpha-range"),
], )
def test_parse_recipe_refuses_with_one_line(text, message):
    with pytest.raises(FFNQuantError) as info:
        parse_recipe(text)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("baseline", ["w8a8", "w8a8@auto", "w4a16-g32"], ids=str)
def test_baseline_must_be_a_float_scheme(baseline):
    with pytest.raises(FFNQuantError, match=f"baseline '{baseline}' must be a float scheme.*valid: fp32, fp16"):
        RunConfig.tiny(schemes=("fp32", baseline), baseline=baseline)


def test_config_that_is_not_a_regular_file_is_refused_without_reading(tmp_path):
    fifo = tmp_path / "run.toml"
    os.mkfifo(fifo)  # reading a FIFO with no writer would block forever
    with pytest.raises(FFNQuantError, match="is not a regular file"):
        load_config(fifo)
    with pytest.raises(FFNQuantError, match="is not a regular file"):
        load_config(tmp_path)


def test_default_config_is_the_issue_default():
    cfg = RunConfig()
    assert cfg.d_model == 512 and len(cfg.variants) == 9 and tuple(map(str, cfg.schemes)) == DEFAULT_SCHEMES
    assert cfg.target_db == 30.0 and cfg.runtimes == ("available",)
    dims = {s.variant.value: s.d_ff for s in cfg.specs()}
    assert dims["relu"] == 2048 and dims["swiglu"] == 1408


@pytest.mark.parametrize("config", ["default", "reports/run.toml", "reports/real-model/run.toml"])
def test_run_never_writes_over_a_committed_report(config):
    """The default output folder, and those of the committed configs the README repeats, hold no committed file
    and are git-ignored: a run leaves the reference reports the README compares with as they are."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    cfg = RunConfig() if config == "default" else load_config(root / config)
    out = cfg.out_reports
    tracked = subprocess.run(["git", "ls-files", "--", out], cwd=root, capture_output=True, text=True, check=True).stdout
    assert tracked == ""
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", out + "/report.json"], cwd=root)
    assert ignored.returncode == 0, f"{out}/ is not git-ignored"


def _nan_file(tmp_path: Path) -> Path:
    arr = np.zeros((600, 64), dtype=np.float32)
    arr[3, 5] = np.nan
    path = tmp_path / "nan.npy"
    np.save(path, arr)
    return path


@pytest.mark.parametrize("extra, message", [
    pytest.param(["--schemes", "fp32,w9a9"], "unknown scheme 'w9a9'", id="unknown-scheme"),
    pytest.param(["--variants", "relu,tanhglu"], "unknown variant 'tanhglu'", id="unknown-variant"),
    pytest.param(["--schemes", "fp32,w8a8@foo"], "unknown calibrator 'foo'", id="unknown-calibrator"),
    pytest.param(["--runtimes", "ort-cuda"], "runtime 'ort-cuda' is not available", id="unavailable-runtime"),
    pytest.param(["--runtimes", "tpu"], "unknown runtime 'tpu'", id="unknown-runtime"),
    pytest.param(["--source", "{tmp}/missing.npy"], "missing.npy", id="missing-data"),
    pytest.param(["--source", "{nan}"], "NaN", id="nan-data"),
    pytest.param(["--schemes", "fp32,llm-int8"], "llm-int8", id="scheme-without-reference"),
    pytest.param(["--tokens", "1,0"], "tokens must be a positive integer", id="zero-tokens"),
    pytest.param(["--config", "{tmp}/nope.toml"], "does not exist", id="missing-config"),
], )
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, extra, message):
    import torch

    if "ort-cuda" in extra and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    nan = _nan_file(tmp_path)
    extra = [a.replace("{tmp}", str(tmp_path)).replace("{nan}", str(nan)) for a in extra]
    out, exp = tmp_path / "reports", tmp_path / "export"
    base = [] if "--config" in extra else ["--tiny"]
    code = main(["run", *base, "--out", str(out), "--export", str(exp), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and message in err[0], err
    assert not out.exists() and not exp.exists()


def test_bad_config_values_name_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('d_model = 64\nschemes = ["fp32", "w8a8"]\ncolour = "blue"\n')
    with pytest.raises(FFNQuantError, match=r"c.toml.*unknown run config key\(s\) colour"):
        load_config(path)
    path.write_text("d_model = [")
    with pytest.raises(FFNQuantError, match="not valid TOML"):
        load_config(path)


def test_runtime_failing_mid_run_is_recorded_and_the_run_completes(tmp_path, monkeypatch):
    from ffnquant.runtimes import torch_rt

    calls = {"n": 0}
    real_load = torch_rt.TorchRuntime.load

    def flaky_load(self, case):
        calls["n"] += 1
        if case.scheme != "fp32":
            raise RuntimeError("simulated kernel crash")
        return real_load(self, case)

    monkeypatch.setattr(torch_rt.TorchRuntime, "load", flaky_load)
    cfg = RunConfig(**dict(SMALL, variants=("relu",), runtimes=("torch-cpu",), schemes=("fp32", "w8a8-dynamic-s8", "w4a16-g32-asym")),
                    out_reports=str(tmp_path / "r"), out_export=str(tmp_path / "e"))
    doc = run(cfg).document
    validate_report(doc)
    lat = doc["timing"]["latency"]
    assert calls["n"] > 1 and lat["status"] == "partial"
    row = next(r for r in lat["runtimes"] if r["name"] == "torch-cpu")
    assert "simulated kernel crash" in row["error"]
    failed = [c for c in lat["cases"] if c["error"]]
    assert failed and all("simulated kernel crash" in c["error"] for c in failed)
    assert any(c["error"] is None and c["scheme"] == "fp32" for c in lat["cases"])
    md = (tmp_path / "r" / "report.md").read_text()
    assert "simulated kernel crash" in md and "## Accuracy on held-out data" in md
