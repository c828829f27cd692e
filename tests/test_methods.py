"""Method handlers (`ffnquant.methods`): one QuantizedLinear per weight that every consumer reads, and a new method
added as one handler plus its preset."""

from __future__ import annotations

import pytest
import torch

from ffnquant.numerics import primitives as P
from ffnquant.errors import FFNQuantError
from ffnquant.methods import MethodHandler, QuantizedLinear, WeightGrid, handler_for, method_names, quantize_linear
from ffnquant.methods import register_method, unregister_method
from ffnquant.schemes import PRESETS, Granularity, Scheme, WeightDType, get_scheme, register_preset, unregister_preset
from ffnquant.spec import FFNSpec, Variant

ON_GRID = [n for n, s in PRESETS.items() if s.no_reference_reason is None and not s.weight_dtype.is_float
           and s.weight_dtype not in (WeightDType.NF4, WeightDType.FP8_E4M3) and handler_for(s).on_grid]


def _decode(ql: QuantizedLinear) -> torch.Tensor:
    """The weight the codes and grid say, cropped to the real input width."""
    g = ql.grid
    out_f, in_f = ql.weight.shape
    if g.granularity == "per_group" or g.group_size:
        groups = g.scale.shape[1]
        codes = ql.codes.reshape(out_f, groups, -1).float()
        w = ((codes - g.zero_point[..., None].float()) * g.scale[..., None]).reshape(out_f, -1)
        return w[:, :in_f]
    return (ql.codes.float() - g.zero_point.float()) * g.scale


@pytest.mark.parametrize("preset", ON_GRID, ids=str)
def test_the_codes_decode_to_the_weight_the_forward_uses(preset):
    """Codes and grid are the weight, exactly: a writer that stores them stores what the reference computes."""
    scheme = get_scheme(preset)
    w = torch.randn(24, 100, generator=torch.Generator().manual_seed(0))
    x = torch.randn(256, 100, generator=torch.Generator().manual_seed(1))
    ql = quantize_linear(w, scheme, (x.T @ x).double())
    assert ql.codes.dtype == torch.int8  # the signed range of 8 bits or fewer
    assert ql.grid.qmin <= int(ql.codes.min()) and int(ql.codes.max()) <= ql.grid.qmax
    assert torch.equal(_decode(ql), ql.weight)


def test_hqq_keeps_its_float_zero_points():
    ql = quantize_linear(torch.randn(8, 64), get_scheme("w4a16-g32-hqq"))
    assert ql.grid is None and ql.zero_float.dtype == torch.float32
    deq = P.int4_group_dequantize(ql.codes, ql.scale_float[..., None], ql.zero_float[..., None], 64)
    assert torch.equal(deq, ql.weight)


def test_every_builtin_method_has_a_handler():
    assert {"rtn", "gptq", "hqq", "awq"} <= set(method_names())
    assert type(handler_for(get_scheme("nf4"))).__name__ == "BitsAndBytes4"  # rtn on a code book
    assert type(handler_for(get_scheme("w8a16"))).__name__ == "RoundToNearest"


# --- a new method is one handler and its preset -------------------------------------------------------------

class TruncateToZero(MethodHandler):
    """A toy method: int8 per-channel symmetric codes rounded toward zero instead of to nearest."""

    method = "trunc"
    describe = "round toward zero"

    def check(self, scheme):
        return None if scheme.weight_dtype is WeightDType.INT8 else "trunc rounds int8 weights only"

    def quantize(self, weight, scheme, hessian=None):
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
        codes = torch.clamp(torch.trunc(w / scale), -127, 127).to(torch.int32)
        grid = WeightGrid("int", 8, "per_channel", True, scale, torch.zeros_like(codes[:, :1]))
        return QuantizedLinear(codes.float() * scale, scheme, grid, codes)


@pytest.fixture
def trunc_method():
    handler = register_method(TruncateToZero())
    preset = register_preset(Scheme("w8a16-trunc", WeightDType.INT8, Granularity.PER_CHANNEL, method="trunc"))
    yield preset
    unregister_preset(preset.name)
    unregister_method(handler)


def test_a_new_method_is_one_handler_and_a_preset(trunc_method, tmp_path):
    """The toy method runs end to end through the code every method shares: the scheme validates through its
    handler, the fake-quant forward and the ONNX artifact both read its codes, and its description is its own."""
    from ffnquant.quantization import quantize_spec

    assert "round toward zero" in trunc_method.description
    with pytest.raises(FFNQuantError, match="trunc rounds int8 weights only"):
        Scheme("w4-trunc", WeightDType.INT4, Granularity.PER_GROUP, group_size=32, method="trunc")
    spec = FFNSpec(Variant.SWIGLU, 32, 64)
    kw = dict(source="gaussian", calib_tokens=256, eval_tokens=128, seed=0, sensitivity=False, baseline=False)
    trunc = quantize_spec(spec, "w8a16-trunc", out_artifacts=tmp_path, **kw)
    rtn = quantize_spec(spec, "w8a16", out_artifacts=tmp_path, **kw)
    ql = trunc.qmodel.linears["w_up"]
    assert torch.equal(trunc.qmodel.model.w_up.weight, ql.codes.float() * ql.grid.scale)  # the forward reads its codes
    assert not torch.equal(ql.codes, rtn.qmodel.linears["w_up"].codes)
    assert trunc.artifact["kind"] == "qdq"
    # the artifact stores the handler's codes: it computes the toy method's numerics, not round-to-nearest's
    gap = abs(trunc.artifact["accuracy_onnx"]["sqnr_db"] - trunc.accuracy.sqnr_db)
    assert gap < 0.01, gap
    assert trunc.accuracy.sqnr_db < rtn.accuracy.sqnr_db - 1.0  # truncation loses about 6 dB against rounding


def test_an_unregistered_method_is_refused_with_the_valid_names(trunc_method):
    unregister_method(handler_for(trunc_method))
    with pytest.raises(FFNQuantError, match="unknown method 'trunc'.*rtn"):
        Scheme("w8-trunc", WeightDType.INT8, Granularity.PER_CHANNEL, method="trunc")
    register_method(TruncateToZero())  # the fixture removes it again


# --- nothing downstream quantizes again ------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["w8a8", "w8a16", "w4a16-g32", "w4a16-g32-asym", "w4a16-g32-hqq",
                                    "w4a16-g32-gptq", "w4a16-g32-awq", "nf4", "fp4"], ids=str)
def test_the_artifact_stores_the_handlers_codes_and_nothing_quantizes_twice(preset, tmp_path, monkeypatch):
    """Each weight is quantized once (GPTQ runs once per weight, not again for the file), onnxruntime's own
    quantizers never run, and the artifact computes the torch reference: its SQNR equals the reference's up to
    float32 summation order (1e-3 dB, where a re-quantized artifact drifted by up to 4e-3 dB on fp4)."""
    import onnxruntime.quantization.matmul_bnb4_quantizer as bnb4q

    from ffnquant.quantization import quantize_spec
    from ffnquant.infra.thirdparty import matmul_nbits_quantizer

    calls = {"gptq": 0}
    real_gptq = P.gptq_int4_codes

    def counted(*args, **kwargs):
        calls["gptq"] += 1
        return real_gptq(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("an onnxruntime quantizer ran on an artifact")

    monkeypatch.setattr(P, "gptq_int4_codes", counted)
    monkeypatch.setattr(bnb4q.MatMulBnb4Quantizer, "process", refuse)
    monkeypatch.setattr(matmul_nbits_quantizer().MatMulNBitsQuantizer, "process", refuse)
    spec = FFNSpec(Variant.SWIGLU, 64, 128)
    res = quantize_spec(spec, preset, source="gaussian", calib_tokens=256, eval_tokens=128, seed=0,
                        sensitivity=False, baseline=False, out_artifacts=tmp_path)
    assert calls["gptq"] == (3 if preset.endswith("gptq") else 0)
    # where this CPU's int8 kernel saturates (ortcpu), the graph's own value is the one the codes decide
    onnx = res.artifact.get("accuracy_onnx_graph") or res.artifact["accuracy_onnx"]
    assert abs(onnx["sqnr_db"] - res.accuracy.sqnr_db) < 1e-3


@pytest.mark.parametrize("recipe", ["w8a8@search+smooth+rotate", "w4a16-g32-gptq", "w8a16", "fp8-e4m3"])
def test_a_quantized_ffn_moves_whole_to_a_device(recipe):
    """`quantized_ffn_to` moves the module and every tensor its `QuantizedLinear`s and grids hold (what a deployment
    writer reads), so a copy quantized on a GPU comes back to host memory whole; `nn.Module.to` moves the module
    only. The meta device stands in for a GPU: after the move no tensor is left behind."""
    from ffnquant.methods.fakequant import quantized_ffn_to
    from ffnquant.model import build
    from ffnquant.quantization import quantize_spec
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    gen = torch.Generator().manual_seed(0)
    q = quantize_spec(spec, recipe, model=build(spec, seed=0), calib_tokens=torch.randn(256, 32, generator=gen),
                      eval_tokens=torch.randn(64, 32, generator=gen), onnx=False).qmodel

    def tensors():
        out = list(q.state_dict().values())
        for ql in q.linears.values():
            out += [v for v in vars(ql).values() if isinstance(v, torch.Tensor)]
            if ql.grid is not None:
                out += [t for t in (ql.grid.scale, ql.grid.zero_point) if t is not None]
        for grid in q.weight_grids.values():
            out += [t for t in (grid.scale, grid.zero_point) if t is not None]
        return out

    assert q.linears and all(t.device.type == "cpu" for t in tensors())
    assert quantized_ffn_to(q, "meta") is q
    assert all(t.device.type == "meta" for t in tensors())
