"""ONNX artifacts: checker-valid, run on onnxruntime's CPU provider, agree with the torch reference within 0.5 dB;
the ORT-default baseline; the `ffnquant quantize` command (files written, bad input = one line, exit 2, nothing written)."""

from pathlib import Path

import onnx
import pytest

from ffnquant import FFNSpec
from ffnquant.cli import main
from ffnquant.onnxquant import artifact_kind, ort_session
from ffnquant.quantize import prepare, quantize_spec
from ffnquant.schemes import get_scheme

D = 64
_PREP = {}


def _prep(variant, tmp_path_factory):
    if variant not in _PREP:
        spec = FFNSpec(variant, d_model=D)
        remedies = dict(smooth=0.5, rotate=True) if variant == "swiglu" else {}
        _PREP[variant] = (spec, prepare(spec, "llm_like", 1024, 512, **remedies), tmp_path_factory.mktemp(variant))
    return _PREP[variant]


ARTIFACT_SCHEMES = ["w8a8", "w8a8-s8", "w8a16", "w4a16-g32", "w4a16-g32-asym", "w4a16-g32-hqq", "w4a16-g32-gptq", "nf4"]


@pytest.mark.parametrize("variant", ["swiglu", "relu"], ids=str)
@pytest.mark.parametrize("scheme", ARTIFACT_SCHEMES, ids=str)
def test_artifact_agrees_with_torch_reference(variant, scheme, tmp_path_factory):
    spec, prep, folder = _prep(variant, tmp_path_factory)
    r = quantize_spec(spec, scheme, "minmax" if get_scheme(scheme).static_activations else None,
                      prepared=prep, out_artifacts=folder, sensitivity=False, baseline=False)
    art = r.artifact
    path = Path(art["path"])
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert ort_session(path).get_providers()[0] == "CPUExecutionProvider"
    assert abs(art["accuracy_onnx"]["sqnr_db"] - r.accuracy.sqnr_db) <= 0.5
    assert art["size_bytes"] == path.stat().st_size
    # smaller than the float export of the same (remedied) graph; a rotation's [b, b] matrix stays float in both
    assert art["size_bytes"] < prep.onnx_file("model", folder).stat().st_size


@pytest.mark.parametrize("variant", ["reglu", "swiglu", "relu"], ids=str)
def test_every_int8_matmul_runs_as_an_integer_kernel(variant, tmp_path):
    """onnxruntime must fuse each DQ -> MatMul into MatMulIntegerToFloat; a MatMul left in float
    (ReGLU's gate before the Relu rewrite) runs 2.4x slower than the whole int8 FFN."""
    import onnxruntime as ort

    spec = FFNSpec(variant, d_model=D)
    prep = prepare(spec, "llm_like", 256, 128)
    r = quantize_spec(spec, "w8a8", "minmax", prepared=prep, out_artifacts=tmp_path, sensitivity=False, baseline=False)
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    opts.log_severity_level = 3
    ort.InferenceSession(r.artifact["path"], opts, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node]
    assert ops.count("MatMulIntegerToFloat") == spec.n_matrices
    assert "MatMul" not in ops and "DequantizeLinear" not in ops


def test_no_artifact_is_explained():
    assert artifact_kind(get_scheme("w8a8-dynamic"))[0] is None
    assert "per tensor" in artifact_kind(get_scheme("w8a8-dynamic"))[1]
    assert artifact_kind(get_scheme("fp8-e4m3"))[0] is None


def test_ffnquant_recipe_beats_ort_default_on_swiglu(tmp_path_factory):
    spec, prep, folder = _prep("swiglu", tmp_path_factory)  # smooth 0.5 + rotate, llm_like inputs
    r = quantize_spec(spec, "w8a8", "mse", prepared=prep, out_artifacts=folder, sensitivity=False)
    base = r.baseline["accuracy_onnx"]["sqnr_db"]
    assert r.artifact["accuracy_onnx"]["sqnr_db"] > base + 3.0


def test_cli_writes_artifacts_and_reports(tmp_path, capsys):
    exp, rep = tmp_path / "export", tmp_path / "reports"
    rc = main(["quantize", "--variants", "reglu", "--d-model", str(D), "--scheme", "w8a8", "--calibrator", "mse",
               "--smooth", "0.5", "--calib-tokens", "512", "--eval-tokens", "256",
               "--out-artifacts", str(exp), "--out-reports", str(rep)])
    assert rc == 0
    names = {p.name for p in exp.iterdir()}
    assert any(n.endswith(".w8a8.onnx") for n in names) and any("ort-default" in n for n in names)
    (js,) = rep.glob("quantize_*.json")
    import json

    data = json.loads(js.read_text())
    assert data["schema_version"] == 1 and data["environment"]["packages"]["torch"]
    assert set(data["ranges"]) == {"input", "hidden"} and data["ort_default_baseline"]["accuracy_onnx"]["sqnr_db"]
    assert Path(data["artifact"]["path"]).exists()
    assert (rep / js.name.replace(".json", ".md")).read_text().startswith("# ffnquant quantize: reglu")
    assert "reglu" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--scheme", "w3a3"], "unknown scheme 'w3a3'; valid: fp32", id="scheme"),
        pytest.param(["--calibrator", "kl"], "unknown calibrator 'kl'; valid: minmax", id="calibrator"),
        pytest.param(["--scheme", "w4a16-g128", "--d-model", "96"], "does not divide d_model=96", id="group-d_model"),
        pytest.param(["--scheme", "w4a16-g64", "--variants", "relu", "--d-ff", "200"], "does not divide d_ff=200", id="group-d_ff"),
        pytest.param(["--calib-tokens", "0"], "needs calibration data", id="no-calibration"),
        pytest.param(["--variants", "gelu", "--smooth", "0.5", "--smooth-sites", "hidden"], "not positively homogeneous", id="gelu-hidden"),
        pytest.param(["--source", "NANFILE"], "NaN", id="nan-data"),
    ],
)
def test_cli_bad_input_one_line_exit_2_nothing_written(args, message, tmp_path, capsys):
    import numpy as np

    nan_file = tmp_path / "tokens.npy"
    x = np.random.default_rng(0).standard_normal((2048, 64)).astype(np.float32)
    x[10, 3] = np.nan
    np.save(nan_file, x)
    args = [str(nan_file) if a == "NANFILE" else a for a in args]
    exp, rep = tmp_path / "export", tmp_path / "reports"
    base = ["quantize", "--d-model", "64", "--calib-tokens", "512", "--eval-tokens", "256", "--out-artifacts", str(exp), "--out-reports", str(rep)]
    rc = main(base + args)
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1
    assert not exp.exists() and not rep.exists()
