"""The backend registry (`ffnquant.backends`): every backend answers whether it takes a recipe, and why not, from
one place that bench, plan and export ask."""

from __future__ import annotations

import pytest

from ffnquant.backends import Support, backend_names, get_backend, register_backend, supports, unregister_backend
from ffnquant.errors import FFNQuantError
from ffnquant.schemes import PRESETS
from ffnquant.spec import FFNSpec, Variant

SPEC = FFNSpec(Variant.SWIGLU, 64, 192)
DECIDED_HERE = ("onnx-artifact", "compressed-tensors")


def test_every_runtime_and_format_is_a_backend():
    from ffnquant.deploy.formats import FORMATS
    from ffnquant.runtimes import RUNTIMES

    names = set(backend_names())
    assert set(RUNTIMES) <= names
    assert {"onnx-artifact", "onnx-graph", "compressed-tensors"} <= names
    assert {"compressed-tensors" if f == "compressed-tensors" else "onnx-graph" for f in FORMATS} <= names


def test_an_unknown_backend_lists_the_valid_ones():
    with pytest.raises(FFNQuantError, match="unknown backend 'vllm'.*compressed-tensors.*onnx-artifact"):
        supports("vllm", "w8a8")


@pytest.mark.parametrize("backend", ["onnx-artifact", "compressed-tensors", "onnx-graph", "ort-cpu", "torch-cpu"],
                         ids=str)
@pytest.mark.parametrize("recipe", ["w8a8", "w8a8-dynamic-s8", "w4a16-g64", "w4a16-g64-hqq", "nf4", "fp8-e4m3",
                                    "w8a8-s8+rotate", "w8a16+float=hidden"], ids=str)
def test_each_answer_is_a_kind_or_one_line_reason(backend, recipe):
    answer = supports(backend, recipe, SPEC)
    assert isinstance(answer, Support) and answer.backend == backend and answer.recipe == recipe
    assert answer.note and "\n" not in answer.note
    assert answer.ok == (answer.why is None)


@pytest.mark.parametrize("preset", [p for p, s in PRESETS.items() if s.no_reference_reason is None], ids=str)
def test_the_artifact_writer_writes_what_the_registry_says(preset, tmp_path):
    """The registry's onnx-artifact answer is the writer's behaviour: a file when it says yes, none when it says no."""
    from ffnquant.quantization import quantize_spec

    spec = FFNSpec(Variant.SWIGLU, 32, 64)
    answer = supports("onnx-artifact", preset)
    res = quantize_spec(spec, preset, source="gaussian", calib_tokens=128, eval_tokens=32, seed=0, sensitivity=False,
                        baseline=False, out_artifacts=tmp_path)
    assert res.artifact["kind"] == answer.kind
    assert (res.artifact.get("path") is not None) == answer.ok


def test_onnxruntime_formats_are_the_artifact_writers_plain_rounding_presets():
    from ffnquant.runtimes.ort import ORT_FORMATS

    for provider, formats in ORT_FORMATS.items():
        for name in formats:
            assert supports("onnx-artifact", name).ok, (provider, name)
    assert ORT_FORMATS["trt"] == ("fp32", "fp16", "w8a8-s8")  # TensorRT: explicit S8S8 int8 only
    assert "w4a16-g64-gptq" not in ORT_FORMATS["cpu"]
    # ... but the plain kernel on the same grid serves it
    assert supports("ort-cpu", "w4a16-g64-gptq").kind == "w4a16-g64"


def test_a_new_backend_is_one_registration():
    def decide(recipe, spec):
        return ("int8", "int8 kernels") if recipe.resolve().weight_bits == 8 else (None, "this toy takes int8 only")

    register_backend("toy-int8", "a toy", decide)
    try:
        assert supports("toy-int8", "w8a8").kind == "int8"
        assert supports("toy-int8", "w4a16-g32").why == "this toy takes int8 only"
        assert get_backend("toy-int8").what == "a toy"
    finally:
        unregister_backend("toy-int8")
