"""ONNX artifacts: checker-valid, run on onnxruntime's CPU provider, agree with the torch reference within 0.5 dB;
the ORT-default baseline; the `ffnquant quantize` command (files written, bad input = one line, exit 2, nothing written)."""

from pathlib import Path

import onnx
import pytest

from ffnquant import FFNSpec
from ffnquant.cli import main
from ffnquant.onnx.onnxquant import artifact_kind, ort_session
from ffnquant.quantization import prepare, quantize_spec
from ffnquant.recipe import Recipe
from ffnquant.schemes import get_scheme
from onnx_checks import graph_db

D = 64


@pytest.fixture(scope="module")
def preps(tmp_path_factory):
    """(spec, prepared, artifact folder) per variant, made on first use and shared within this module only;
    swiglu is prepared with smooth 0.5 + rotate."""
    made = {}

    def get(variant):
        if variant not in made:
            spec = FFNSpec(variant, d_model=D)
            remedies = dict(smooth=0.5, rotate=True) if variant == "swiglu" else {}
            made[variant] = (spec, prepare(spec, "llm_like", 1024, 512, **remedies), tmp_path_factory.mktemp(variant))
        return made[variant]

    return get


def _recipe(scheme, prep, calibrator=None):
    """The recipe of `scheme` with the prepared calibration's remedies."""
    return Recipe(scheme, calibrator, smooth=prep.smooth, rotate=prep.rotate)


ARTIFACT_SCHEMES = ["w8a8", "w8a8-s8", "w8a16", "w4a16-g32", "w4a16-g32-asym", "w4a16-g32-hqq", "w4a16-g32-gptq", "nf4"]


@pytest.mark.parametrize("variant", ["swiglu", "relu"], ids=str)
@pytest.mark.parametrize("scheme", ARTIFACT_SCHEMES, ids=str)
def test_artifact_agrees_with_torch_reference(variant, scheme, preps):
    spec, prep, folder = preps(variant)
    recipe = _recipe(scheme, prep, "minmax" if get_scheme(scheme).static_activations else None)
    r = quantize_spec(spec, recipe, prepared=prep, out_artifacts=folder, sensitivity=False, baseline=False)
    art = r.artifact
    path = Path(art["path"])
    assert path.name == f"{spec.key}.{recipe.slug}.onnx"  # the recipe's slug is the file name
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert ort_session(path).get_providers()[0] == "CPUExecutionProvider"
    assert abs(graph_db(art) - r.accuracy.sqnr_db) <= 0.5
    assert art["size_bytes"] == path.stat().st_size
    # smaller than the float export of the same (remedied) graph; a rotation's [b, b] matrix stays float in both
    assert art["size_bytes"] < prep.onnx_file("model", folder).stat().st_size


PADDED_SCHEMES = ["w4a16-g64", "w4a16-g64-asym", "w4a16-g64-hqq", "w4a16-g64-gptq", "w4a16-g128", "nf4", "fp4"]


@pytest.fixture(scope="module")
def padded_preps(tmp_path_factory):
    """Widths that groups of 64 do not divide: swiglu 96 -> 160, relu (with bias) 96 -> 384 (g128: 96 < g)."""
    made = {}

    def get(variant):
        if variant not in made:
            spec = FFNSpec("swiglu", d_model=96, d_ff=160) if variant == "swiglu" else FFNSpec("relu", d_model=96, bias=True)
            made[variant] = (spec, prepare(spec, "llm_like", 1024, 512), tmp_path_factory.mktemp(f"padded-{variant}"))
        return made[variant]

    return get


@pytest.mark.parametrize("variant", ["swiglu", "relu"], ids=str)
@pytest.mark.parametrize("scheme", PADDED_SCHEMES, ids=str)
def test_padded_groups_artifact_agrees_with_torch_reference(variant, scheme, padded_preps):
    """K not a multiple of the group: MatMulNBits keeps K = the real width with ceil(K / block_size)
    blocks of padded codes (MatMulBnb4: flattened blocks, the last partial); onnxruntime's output
    agrees with the padded torch reference within 0.5 dB."""
    spec, prep, folder = padded_preps(variant)
    assert spec.d_model % 64 and (variant == "relu" or spec.d_ff % 64)
    r = quantize_spec(spec, Recipe(scheme), prepared=prep, out_artifacts=folder, sensitivity=False, baseline=False)
    path = Path(r.artifact["path"])
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    if get_scheme(scheme).weight_dtype.value == "int4":
        attrs = [{a.name: a.i for a in n.attribute} for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert sorted(a["K"] for a in attrs) == sorted(w[1] for w in spec.weight_shapes.values())
        assert all(a["block_size"] == get_scheme(scheme).group_size for a in attrs)
    assert abs(graph_db(r.artifact) - r.accuracy.sqnr_db) <= 0.5
    assert r.accuracy.sqnr_db > 10.0


@pytest.mark.parametrize("variant", ["reglu", "swiglu", "relu"], ids=str)
def test_every_int8_matmul_runs_as_an_integer_kernel(variant, tmp_path):
    """onnxruntime must fuse each DQ -> MatMul into MatMulIntegerToFloat; a MatMul left in float
    (ReGLU's gate before the Relu rewrite) runs 2.4x slower than the whole int8 FFN."""
    import onnxruntime as ort

    spec = FFNSpec(variant, d_model=D)
    prep = prepare(spec, "llm_like", 256, 128)
    r = quantize_spec(spec, "w8a8@minmax", prepared=prep, out_artifacts=tmp_path, sensitivity=False, baseline=False)
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


def test_ffnquant_recipe_beats_ort_default_on_swiglu(preps):
    spec, prep, folder = preps("swiglu")  # smooth 0.5 + rotate, llm_like inputs
    r = quantize_spec(spec, "w8a8@mse+smooth+rotate", prepared=prep, out_artifacts=folder, sensitivity=False)
    assert graph_db(r.artifact) > graph_db(r.baseline) + 3.0
    # the artifact and the remedied fp32 export are named from the recipe's slugs
    assert Path(r.artifact["path"]).name == f"{spec.key}.w8a8-mse.smooth0.5-rotate.onnx"
    assert prep.onnx_file("model", folder).name == f"{spec.key}.smooth0.5-rotate.fp32.onnx"
    assert Path(r.baseline["path"]).name == f"{spec.key}.ort-default-static.onnx"


def test_cli_writes_artifacts_and_reports(tmp_path, capsys):
    exp, rep = tmp_path / "export", tmp_path / "reports"
    rc = main(["quantize", "--variants", "reglu", "--d-model", str(D), "--scheme", "w8a8", "--calibrator", "mse",
               "--smooth", "0.5", "--calib-tokens", "512", "--eval-tokens", "256",
               "--out-artifacts", str(exp), "--out-reports", str(rep)])
    assert rc == 0
    names = {p.name for p in exp.iterdir()}
    assert "reglu_d64_ff256.w8a8-mse.smooth0.5.onnx" in names and any("ort-default" in n for n in names)
    (js,) = rep.glob("quantize_*.json")
    import json

    data = json.loads(js.read_text())
    assert data["schema_version"] == 1 and data["environment"]["packages"]["torch"]
    assert set(data["ranges"]) == {"input", "hidden"} and data["ort_default_baseline"]["accuracy_onnx"]["sqnr_db"]
    assert Path(data["artifact"]["path"]).exists()
    assert (rep / js.name.replace(".json", ".md")).read_text().startswith("# ffnquant quantize: reglu")
    assert "reglu" in capsys.readouterr().out


def test_cli_recipe_text_and_flags_build_the_same_recipe_parsed_once(tmp_path, recipe_parses):
    """`--recipe` takes `ffnquant run --schemes`' grammar; the old flags are sugar for the same Recipe: the same
    files, the same numbers. Each command parses its recipe once; giving both forms is an error."""
    import json


    common = ["quantize", "--variants", "relu", "--d-model", "32", "--calib-tokens", "256", "--eval-tokens", "128",
              "--no-onnx"]
    out = {}
    for form, args in {"text": ["--recipe", "w8a8@mse+smooth=0.3+rotate"],
                       "flags": ["--scheme", "w8a8", "--calibrator", "mse", "--smooth", "0.3", "--rotate"]}.items():
        recipe_parses.clear()
        rep = tmp_path / form
        assert main(common + args + ["--out-reports", str(rep)]) == 0
        assert recipe_parses == (["w8a8@mse+smooth=0.3+rotate"] if form == "text" else [])
        (js,) = rep.glob("quantize_*.json")
        assert js.name == "quantize_relu_d32_ff128.w8a8-mse.smooth0.3-rotate.json"
        out[form] = json.loads(js.read_text())
    assert out["text"]["recipe"] == out["flags"]["recipe"] == "w8a8@mse+smooth=0.3+rotate"
    assert out["text"]["accuracy_torch"] == out["flags"]["accuracy_torch"]


def test_cli_recipe_and_flags_together_is_an_error(tmp_path, capsys):
    rc = main(["quantize", "--variants", "relu", "--d-model", "32", "--recipe", "w8a8", "--smooth", "0.5",
               "--out-artifacts", str(tmp_path / "e"), "--out-reports", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "--recipe" in err and "--smooth" in err and err.count("\n") == 1
    assert not (tmp_path / "e").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--scheme", "w3a3"], "unknown scheme 'w3a3'; valid: fp32", id="scheme"),
        pytest.param(["--calibrator", "kl"], "unknown calibrator 'kl'; valid: minmax", id="calibrator"),
        pytest.param(["--calib-tokens", "0"], "needs calibration data", id="no-calibration"),
        pytest.param(["--recipe", "w8a8+bogus"], "bogus", id="recipe-remedy"),
        pytest.param(["--recipe", "w8a8-dynamic@mse"], "w8a8-dynamic", id="recipe-calibrator-on-dynamic"),
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
