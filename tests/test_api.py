"""The Python API (`ffnquant.quantize / export_onnx / evaluate / profile / run`): a synthetic variant and a real
model's FFN layer go through the same verbs; the numbers are `quantize_spec`'s; the README's example runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import ffnquant
from ffnquant.errors import FFNQuantError
from ffnquant.onnx.onnxquant import run_onnx
from ffnquant.quantization import prepare, quantize_spec
from ffnquant.recipe import Recipe

from hf_models import D as HF_D, write_llama_like
from onnx_checks import graph_session

D = 32
ROOT = Path(__file__).resolve().parents[1]


def test_the_verbs_are_the_package_attributes():
    import ffnquant.api as api
    from ffnquant.quantization import quantize_spec as core

    assert ffnquant.quantize is api.quantize and ffnquant.run is api.run and callable(core)
    for name in ("quantize", "export_onnx", "evaluate", "profile", "run", "QuantizedFFN", "Recipe"):
        assert name in ffnquant.__all__ and getattr(ffnquant, name) is not None


def test_synthetic_variant_numbers_are_quantize_spec_numbers(tmp_path):
    spec = ffnquant.FFNSpec("swiglu", d_model=D)
    q = ffnquant.quantize(spec, "w8a8@mse+smooth", "llm_like", calib_tokens=512, eval_tokens=256)
    assert isinstance(q, ffnquant.QuantizedFFN) and q.recipe == Recipe("w8a8", "mse", smooth=0.5)
    assert q.prepared.reference is not q.prepared.model  # the float reference is the FFN before smoothing
    acc = ffnquant.evaluate(q)
    ref = quantize_spec(spec, "w8a8@mse+smooth", calib_tokens=512, eval_tokens=256, source="llm_like", onnx=False,
                        sensitivity=False)
    assert acc.sqnr_db == ref.accuracy.sqnr_db and acc.n_tokens == 256
    assert 25 < acc.sqnr_db < 200

    # the artifact: written where asked, onnxruntime computes what the torch reference computes
    path = ffnquant.export_onnx(q, tmp_path / "out" / "swiglu.onnx")
    assert path == tmp_path / "out" / "swiglu.onnx" and sorted(p.name for p in path.parent.iterdir()) == ["swiglu.onnx"]
    x = q.prepared.eval
    onnx_db = ffnquant.numerics.accuracy.sqnr_db(q.prepared.reference(x).detach(), run_onnx(graph_session(path), x))
    assert abs(onnx_db - acc.sqnr_db) < 0.5


def test_an_ffn_module_with_calibration_tokens_and_explicit_evaluation_tokens():
    gen = torch.Generator().manual_seed(0)
    model = ffnquant.build(ffnquant.FFNSpec("relu", d_model=D), seed=3)
    calib, held = torch.randn(512, D, generator=gen), torch.randn(128, D, generator=gen)
    q = ffnquant.quantize(model, Recipe("w8a8", "minmax"), calib, held_out=held)
    assert q.prepared.reference is model
    prep = prepare(model.spec, calib_tokens=calib, eval_tokens=held, model=model)
    assert ffnquant.evaluate(q).sqnr_db == quantize_spec(model.spec, "w8a8@minmax", prep, onnx=False,
                                                         sensitivity=False).accuracy.sqnr_db
    other = torch.randn(64, 4, D, generator=gen)  # any (..., d_model) shape
    assert ffnquant.evaluate(q, other).n_tokens == 256


def test_a_real_models_ffn_layer(tmp_path):
    import onnx

    from ffnquant.hf import load_ffn_layers

    write_llama_like(tmp_path / "m")
    (layer,) = load_ffn_layers(tmp_path / "m", layers="1")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(600, HF_D, generator=gen)
    q = ffnquant.quantize(layer, "w4a16-g32-gptq", tokens[:400], held_out=tokens[400:])
    assert q.prepared.reference is layer.ffn and q.prepared.stem == "L1"
    acc = ffnquant.evaluate(q)
    assert 10 < acc.sqnr_db < 200 and acc.n_tokens == 200
    path = ffnquant.export_onnx(q, tmp_path / "layer1.onnx")
    assert "MatMulNBits" in {n.op_type for n in onnx.load(str(path)).graph.node}
    assert abs(ffnquant.numerics.accuracy.sqnr_db(layer.ffn(tokens[400:]).detach(), run_onnx(path, tokens[400:])) - acc.sqnr_db) < 0.5
    table = ffnquant.profile(layer, tokens)
    assert table.n_tokens == 600 and "hidden" in table


def test_profile_of_a_spec_and_a_source_name():
    table = ffnquant.profile(ffnquant.FFNSpec("gelu", d_model=D), "gaussian", n_tokens=256)
    assert table.n_tokens == 256 and {"input", "hidden"} <= set(table.summary()["sites"])


def test_errors_say_what_was_expected(tmp_path):
    spec = ffnquant.FFNSpec("relu", d_model=D)
    with pytest.raises(FFNQuantError, match="FFNSpec"):
        ffnquant.quantize("relu", "w8a8")
    with pytest.raises(FFNQuantError, match="w3a3"):
        ffnquant.quantize(spec, "w3a3")
    with pytest.raises(FFNQuantError, match="expected"):
        ffnquant.quantize(spec, "w8a8", torch.randn(16, D + 1))
    q = ffnquant.quantize(spec, "fp8-e4m3", "gaussian", calib_tokens=256, eval_tokens=64)
    with pytest.raises(FFNQuantError, match="no ONNX artifact"):
        ffnquant.export_onnx(q, tmp_path / "fp8.onnx")
    assert not (tmp_path / "fp8.onnx").exists()
    with pytest.raises(FFNQuantError, match="ffnquant.quantize"):
        ffnquant.export_onnx(ffnquant.build(spec), tmp_path / "x.onnx")


def test_run_delegates_to_the_pipeline(monkeypatch):
    import ffnquant.pipeline as pipeline

    seen = {}
    monkeypatch.setattr(pipeline, "run", lambda config, **kw: seen.setdefault("call", (config, kw)))
    config = pipeline.RunConfig(variants=("relu",), d_model=32)
    assert ffnquant.run(config, command="x") == (config, {"command": "x"})


def _readme_python_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Python API section has no python code block"
    return match.group(1)


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    code = _readme_python_example()
    assert len(code.strip().splitlines()) <= 6  # about five lines
    monkeypatch.chdir(tmp_path)  # it writes its ONNX file to the working folder
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out.split()
    assert float(out[0]) > 25.0  # SQNR dB of w8a8 + smooth on a swiglu
    assert (tmp_path / "swiglu.w8a8.onnx").is_file()
