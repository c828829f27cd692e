import onnx
import pytest

from ffnquant.errors import FFNQuantError
from ffnquant.onnx.export import FP32_TOLERANCE, check_parity, export_onnx, export_spec, fp16_tolerance, onnx_path_for
from ffnquant.model import build
from ffnquant.spec import FFNSpec, Variant


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_export_round_trip_on_onnxruntime(variant, tmp_path):
    spec = FFNSpec(variant, 32, d_ff=64)
    result = export_spec(spec, tmp_path, dtypes=("fp32", "fp16"), seed=1)
    for dtype, path in result.paths.items():
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        assert model.ir_version <= 10, "this onnxruntime rejects IR versions above 10 from the exporter"
        props = {p.key: p.value for p in model.metadata_props}
        assert props["variant"] == variant.value
        assert props["d_model"] == "32" and props["d_ff"] == "64" and props["dtype"] == dtype
        assert props["bias"] == str(spec.bias).lower()
        assert "ffnquant_version" in props
        dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        assert dims == ["batch", "seq", 32], "batch and sequence axes are dynamic"
        check = result.parity[dtype]
        assert check.provider == "CPUExecutionProvider"
        assert check.passed
    assert result.parity["fp32"].max_abs_error <= FP32_TOLERANCE


def test_gelu_exports_as_one_fused_op_at_opset_20(tmp_path):
    path, _ = export_onnx(build(FFNSpec("gelu", 16)), tmp_path / "g.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "Gelu" in ops and "Tanh" not in ops and "Erf" not in ops


def test_parity_check_detects_a_wrong_model(tmp_path):
    spec = FFNSpec("swiglu", 16)
    path, _ = export_onnx(build(spec, seed=0), tmp_path / "a.onnx")
    other = build(spec, seed=1)
    assert not check_parity(other, path).passed


def test_fp16_tolerance_scales_with_output():
    assert fp16_tolerance(0.1) == pytest.approx(1e-2)
    assert fp16_tolerance(10.0) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"dtype": "int3"}, "unknown export dtype 'int3'; valid: fp32, fp16", id="dtype"),
        pytest.param({"opset": 13}, "opset must be >= 17", id="opset"),
    ],
)
def test_export_rejects_bad_arguments_and_writes_nothing(kwargs, message, tmp_path):
    with pytest.raises(FFNQuantError, match=message):
        export_onnx(build(FFNSpec("relu", 16)), tmp_path / "x.onnx", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_file_names_say_variant_sizes_and_dtype(tmp_path):
    assert onnx_path_for(FFNSpec("swiglu", 512), tmp_path, "fp16").name == "swiglu_d512_ff1408.fp16.onnx"
    assert onnx_path_for(FFNSpec("relu", 512, bias=False), tmp_path, "fp32").name == "relu_d512_ff2048_nobias.fp32.onnx"


def _remedied(model, kind):
    """`model` with a remedy in its transform slots (the structures a real model's layers export with)."""
    import torch

    from ffnquant.numerics import remedies as R
    from ffnquant.numerics.observe import profile

    if kind == "plain":
        return model
    table = profile(model, [torch.randn(64, model.spec.d_model)], sites=["input", "hidden"], weights=False)
    smoothed, _ = R.smooth(model, table, 0.5, sites=["input"])
    return smoothed if kind == "smooth" else R.rotate(smoothed)[0]


# every variant and remedy in float32; in float16 each variant once, with the remedy that changes the graph most
SAME_STRUCTURE = [(v, r, "fp32") for v in ("swiglu", "relu", "gelu") for r in ("plain", "smooth", "smooth-rotate")] + \
                 [(v, "smooth-rotate", "fp16") for v in ("swiglu", "relu", "gelu")]


@pytest.mark.parametrize("variant, remedy, dtype", SAME_STRUCTURE, ids=["-".join(c) for c in SAME_STRUCTURE])
def test_same_structure_reuses_the_graph_with_each_models_own_weights(variant, remedy, dtype, tmp_path, monkeypatch):
    """Layers of one structure export once (torch.onnx.export is the slow part of a real model's run); every
    later file carries its own model's weights: parity against its own model, not the first one's."""
    import ffnquant.onnx.export as E

    monkeypatch.setattr(E, "_TEMPLATES", {})
    calls = []
    real = E._export_proto
    monkeypatch.setattr(E, "_export_proto", lambda *a: calls.append(1) or real(*a))
    spec = FFNSpec(variant, d_model=32)
    for seed in range(3):
        model = _remedied(build(spec, seed=seed), remedy)
        path, _ = export_onnx(model, tmp_path / f"{seed}.onnx", dtype=dtype)
        assert check_parity(model, path, dtype=dtype).passed
    assert len(calls) == 1


def test_a_graph_whose_tensors_cannot_be_told_apart_is_exported_every_time(tmp_path, monkeypatch):
    """Equal w_gate and w_up leave the template's mapping ambiguous: no reuse, and each file is still right."""
    import torch

    import ffnquant.onnx.export as E

    monkeypatch.setattr(E, "_TEMPLATES", {})
    calls = []
    real = E._export_proto
    monkeypatch.setattr(E, "_export_proto", lambda *a: calls.append(1) or real(*a))
    spec = FFNSpec("swiglu", d_model=32)
    for seed in range(2):
        model = build(spec, seed=seed)
        with torch.no_grad():
            model.w_gate.weight.copy_(model.w_up.weight)
        path, _ = export_onnx(model, tmp_path / f"{seed}.onnx")
        assert check_parity(model, path).passed
    assert len(calls) == 2


@pytest.mark.parametrize("argv, message", [
    (["--format", "onnx"], "--format is an option of --model --plan exports; give --model and --plan"),
    (["--force"], "--force is an option of --model --plan exports"),
    (["--eval-text", "prose", "--compute-dtype", "bfloat16"],
     "--compute-dtype, --eval-text are options of --model --plan exports"),
    (["--model", "m", "--plan", "p.toml"], "--out is required with --model"),
    (["--model", "m", "--plan", "p.toml", "--out", "o", "--opset", "5"],
     "--opset is an option of FFN variant exports, not read by --model --plan exports"),
    (["--model", "m", "--plan", "p.toml", "--out", "o", "--dtypes", "fp64"], "--dtypes is an option of FFN variant"),
    (["--model", "m", "--plan", "p.toml", "--out", "o", "--opset", "20", "--d-model", "64"],
     "--opset, --d-model are options of FFN variant exports"),
], ids=["format-without-model", "force-without-model", "texts-without-model", "model-without-out",
        "plan-with-opset", "plan-with-dtypes", "plan-with-opset-and-width"])
def test_deployment_flags_need_a_model_and_an_out(argv, message, tmp_path, capsys, monkeypatch):
    from ffnquant.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_an_exported_graph_names_no_file_of_this_machine(tmp_path):
    """The dynamo exporter writes each op's Python stack trace (source paths) into the node metadata: removed."""
    import onnx

    from ffnquant.onnx.export import export_onnx
    from ffnquant.spec import FFNSpec
    from ffnquant.model import FFN

    path = tmp_path / "f.onnx"
    export_onnx(FFN(FFNSpec("swiglu", d_model=16)), path)
    proto = onnx.load(str(path))
    keys = {p.key for node in proto.graph.node for p in node.metadata_props}
    assert "pkg.torch.onnx.stack_trace" not in keys
    assert __file__.rsplit("/tests/", 1)[0] not in path.read_bytes().decode("latin-1")
