"""onnxruntime's best of its own quantizers (ffnquant.onnx.ortbaseline): every method scored, the best is the max, a
method onnxruntime fails on is recorded (not raised), temporary files are removed, recipes are set against the best."""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path

import pytest

from ffnquant import FFNSpec
from ffnquant.numerics.accuracy import sqnr_db
from ffnquant.errors import FFNQuantError
from ffnquant.onnx.onnxquant import run_onnx
from ffnquant.onnx.ortbaseline import ORT_METHODS, _floats_per_token, compare_with_ort, ort_baselines, versus_ort
from ffnquant.quantization import prepare

D = 64  # swiglu d_ff = 256


@pytest.fixture(scope="module")
def swiglu(tmp_path_factory):
    """A tiny swiglu FFN on llm_like tokens (outlier channels), its fp32 export, and onnxruntime's four baselines.

    1500 calibration tokens: batches of 1024 and 476, the ragged case Percentile/Entropy fail on when given batches."""
    prep = prepare(FFNSpec("swiglu", d_model=D), "llm_like", 1500, 512)
    folder = tmp_path_factory.mktemp("ort")
    fp32 = prep.onnx_file("reference", folder)
    assert [b.shape[0] for b in prep.calib_batches()] == [1024, 476]
    return prep, fp32, ort_baselines(fp32, prep.calib_batches(), prep.eval, prep.ref_eval())


@pytest.mark.parametrize("method", list(ORT_METHODS), ids=str)
def test_every_method_gives_a_finite_sqnr(method, swiglu):
    """int8 weights and activations around three stacked matmuls, activation ranges widened by llm_like's x50
    outlier channels: 25-29 dB measured; 15 dB is far below that and far above a wrong scale or zero point
    (which gives < 5 dB)."""
    prep, _, res = swiglu
    row = res["methods"][method]
    assert row["ok"] and row["error"] is None, row["error"]
    assert math.isfinite(row["sqnr_db"]) and 15.0 < row["sqnr_db"] < 60.0
    assert row["accuracy"]["sqnr_db"] == row["sqnr_db"] and row["accuracy"]["n_tokens"] == prep.eval.shape[0]
    assert row["size_bytes"] > 0 and row["seconds"] >= row["quantize_seconds"] > 0
    assert row["path"] is None  # no out_dir: the files were temporary
    assert res["calib_tokens"] == 1500 and res["eval_tokens"] == 512


def test_best_is_the_max(swiglu):
    _, _, res = swiglu
    best = res["best"]
    assert best["sqnr_db"] == max(r["sqnr_db"] for r in res["methods"].values())
    assert res["methods"][best["method"]]["sqnr_db"] == best["sqnr_db"]


def test_minmax_is_the_default_baseline_and_entropy_computes_its_ranges(swiglu, tmp_path):
    """'minmax' has ort_default_static's settings, so the same SQNR on the same tokens; Entropy at quantize_static's
    128 bins / 128 quantized bins has one candidate threshold, the whole range clipped to [min, max]: MinMax's."""
    prep, _, res = swiglu
    baseline = prep.onnx_file("baseline", tmp_path)
    assert res["methods"]["minmax"]["sqnr_db"] == pytest.approx(sqnr_db(prep.ref_eval(), run_onnx(baseline, prep.eval)),
                                                                abs=1e-9)
    assert res["methods"]["entropy"]["sqnr_db"] == pytest.approx(res["methods"]["minmax"]["sqnr_db"], abs=1e-9)


def test_a_method_onnxruntime_fails_on_is_recorded_not_raised(swiglu):
    """No calibration data: quantize_static's calibrators refuse ('No data is collected.'); quantize_dynamic needs none."""
    prep, fp32, _ = swiglu
    res = ort_baselines(fp32, [], prep.eval, prep.ref_eval())
    for method in ("minmax", "percentile", "entropy"):
        row = res["methods"][method]
        assert not row["ok"] and row["sqnr_db"] is None
        assert row["error"] == "ValueError: No data is collected."
    assert res["methods"]["dynamic"]["ok"] and res["best"]["method"] == "dynamic"


def test_memory_estimate_and_refusal(swiglu, monkeypatch):
    """The histogram calibrators hold every activation: swiglu has 2 d-wide (input, output) and 5 d_ff-wide float
    activations per token; a machine without room for them records the refusal, MinMax (reductions only) runs."""
    import ffnquant.infra.resources as resources

    prep, fp32, _ = swiglu
    f = prep.spec.d_ff
    assert _floats_per_token(fp32) == (2 * D + 5 * f, f)
    monkeypatch.setattr(resources, "_UNCHECKED_BYTES", 0)
    monkeypatch.setattr(resources, "available_memory", lambda: 1_000_000)
    res = ort_baselines(fp32, prep.calib_batches(), prep.eval, prep.ref_eval(), methods=("minmax", "percentile"))
    need = 1500 * (2 * D + 5 * f + 2 * f) * 4
    assert need > 1_000_000
    assert res["methods"]["minmax"]["ok"] and res["best"]["method"] == "minmax"
    err = res["methods"]["percentile"]["error"]
    assert err.startswith("FFNQuantError: onnxruntime's percentile calibration of 1500 tokens needs") and "fewer" in err


def test_temporary_files_are_removed_and_out_dir_keeps_them(swiglu, tmp_path, monkeypatch, capsys):
    """Without out_dir nothing is left in the temporary folder (onnxruntime's own augmented models included); with
    it the files are there under their names and nothing half-written. Nothing prints, the root logger's level
    is as it was."""
    prep, fp32, _ = swiglu
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    root_level = logging.getLogger().level
    methods = ("percentile", "dynamic")  # a calibrated one (onnxruntime's own temporary folder) and one without
    ort_baselines(fp32, prep.calib_batches(), prep.eval, prep.ref_eval(), methods=methods)
    assert list(scratch.iterdir()) == []
    out = tmp_path / "out"
    res = ort_baselines(fp32, prep.calib_batches(), prep.eval, prep.ref_eval(), out_dir=out, methods=methods, stem="ffn")
    assert sorted(p.name for p in out.iterdir()) == sorted(f"ffn.ort-{m}.onnx" for m in methods)
    for m, row in res["methods"].items():
        assert Path(row["path"]) == out / f"ffn.ort-{m}.onnx" and row["size_bytes"] == Path(row["path"]).stat().st_size
    assert capsys.readouterr().out == "" and logging.getLogger().level == root_level


def test_unknown_method_is_refused_before_any_work(swiglu, tmp_path):
    prep, fp32, _ = swiglu
    with pytest.raises(FFNQuantError, match="unknown onnxruntime quantization method 'kl'; valid: minmax, percentile"):
        ort_baselines(fp32, prep.calib_batches(), prep.eval, prep.ref_eval(), out_dir=tmp_path / "o", methods=("kl",))
    assert not (tmp_path / "o").exists()


def test_versus_ort_margin_and_verdict():
    base = {"best": {"method": "percentile", "sqnr_db": 30.0}}
    rows = versus_ort(base, {"a": 30.0, "b": 29.5, "c": 33.0})
    assert [rows[k]["matches_or_beats"] for k in "abc"] == [True, False, True]
    assert rows["b"]["margin_db"] == pytest.approx(-0.5) and rows["c"]["ort_best"] == "percentile"
    assert versus_ort({"best": None}, {"a": 1.0})["a"]["matches_or_beats"] is None


def test_compare_with_ort_on_the_same_tokens(swiglu):
    """Recipes with other remedies get their own calibration of the same reference and tokens; on llm_like inputs
    SmoothQuant moves the outlier channels into the weights, which onnxruntime's quantizers never do: it beats
    their best (the int8 comparison report measures 10+ dB at d=512)."""
    prep, _, _ = swiglu
    out = compare_with_ort(prep, ["w8a8@minmax", "w8a8@search+smooth", "w8a8-dynamic-s8"],
                           methods=("minmax", "percentile"))
    assert set(out["ort"]["methods"]) == {"minmax", "percentile"}
    best = out["ort"]["best"]["sqnr_db"]
    rows = out["recipes"]
    assert list(rows) == ["w8a8@minmax", "w8a8@search+smooth", "w8a8-dynamic-s8"]
    for row in rows.values():
        assert row["margin_db"] == pytest.approx(row["sqnr_db"] - best) and row["matches_or_beats"] == (row["sqnr_db"] >= best)
    assert rows["w8a8@search+smooth"]["matches_or_beats"]
    assert set(rows["w8a8@minmax"]["calibrators"]) == {"input", "hidden"} and rows["w8a8-dynamic-s8"]["calibrators"] == {}
