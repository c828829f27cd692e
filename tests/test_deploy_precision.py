"""deploy.precision: a quantized FFN as a runtime computes it in bf16 / fp16."""

from __future__ import annotations

import pytest
import torch

from ffnquant import build
from ffnquant.deploy import precision
from ffnquant.errors import FFNQuantError
from ffnquant.methods.fakequant import input_hessians, quantize_model
from ffnquant.numerics.observe import profile
from ffnquant.recipe import Recipe
from ffnquant.schemes import get_scheme
from ffnquant.spec import FFNSpec, Variant

pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

SPEC = FFNSpec(Variant.SWIGLU, 64, 96)


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                         ("FP16", torch.float16), ("float32", torch.float32)])
def test_compute_dtype_names(name, dtype):
    assert precision.compute_dtype(name) is dtype


def test_an_unknown_compute_dtype_lists_the_valid_ones():
    with pytest.raises(FFNQuantError, match=r"^unknown compute dtype 'int8'; valid: float32, bfloat16, float16$"):
        precision.compute_dtype("int8")


@pytest.mark.parametrize("dtype, step", [(torch.float32, 2.0 ** -23), (torch.bfloat16, 2.0 ** -7),
                                         (torch.float16, 2.0 ** -10)], ids=["fp32", "bf16", "fp16"])
def test_the_rounding_step_is_the_dtypes_epsilon(dtype, step):
    assert precision.rounding_step(dtype) == step
    assert torch.tensor(1 + step, dtype=dtype) != 1  # one step above 1 is a value of the dtype


def _quantized(recipe: str):
    """A small SwiGLU FFN quantized under `recipe` on two random batches, and the batches."""
    model = build(SPEC, seed=0)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(48, SPEC.d_model, generator=gen) for _ in range(2)]
    r = Recipe.parse(recipe)
    table = profile(model, batches, weights=False)
    hessians = input_hessians(model, batches) if get_scheme(r.scheme).needs_hessians else None
    return quantize_model(model, r.scheme, table, r.calibrator, hessians=hessians), batches


_RECIPES = ["w8a8", "w8a8-s8", "w8a8-dynamic-s8", "w8a16", "w4a16-g32", "w4a16-g32-asym", "w4a16-g32-gptq",
            "fp8-e4m3", "fp8-e4m3-dynamic"]


def test_float32_is_the_quantized_ffn_itself():
    q, _ = _quantized("w8a8")
    assert precision.in_dtype(q, torch.float32) is q


@pytest.mark.parametrize("recipe", _RECIPES)
def test_in_bf16_scales_are_bf16_values_and_the_codes_are_kept(recipe):
    """Each grid's scale is rounded to bf16 and its codes kept: the weight is (code - zero) * scale, computed
    exactly and rounded once to bf16 (as compressed-tensors decompresses it in a bf16 model); static input scales
    are bf16 values, zero points unchanged."""
    q, batches = _quantized(recipe)
    low = precision.in_dtype(q, torch.bfloat16)
    assert low.quantized_sites == q.quantized_sites and set(low.weight_grids) == set(q.weight_grids)
    for name, grid in q.weight_grids.items():
        new = low.weight_grids[name]
        assert torch.equal(new.scale, grid.scale.to(torch.bfloat16).float())
        w32, w16 = getattr(q.model, name).weight, getattr(low.model, name).weight
        assert w16.dtype == torch.bfloat16
        s32 = precision._expand(grid.scale, grid, w32.shape)
        s16 = precision._expand(new.scale, new, w32.shape)
        if grid.kind == "fp8":
            codes = (w32 / s32).to(torch.float8_e4m3fn).float()
            assert torch.equal(codes * s32, w32)
        else:
            z = precision._expand(grid.zero_point.float(), grid, w32.shape)
            codes = torch.round(w32 / s32 + z) - z
            assert torch.equal((codes * s32), w32)  # the float32 grid's codes, exactly
        assert torch.equal(w16, (codes * s16).to(torch.bfloat16))
    for site, r in q.ranges.items():
        got = low.ranges[site]
        assert got.scale == float(torch.tensor(r.scale).to(torch.bfloat16)) and got.zero_point == r.zero_point
    with torch.no_grad():
        y = low(batches[0].to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == batches[0].shape


@pytest.mark.parametrize("recipe", ["w8a8", "w8a8-s8"], ids=["uint8-asymmetric", "int8-symmetric"])
def test_in_bf16_the_static_input_quantizer_is_compressed_tensors_own(recipe):
    """The input site runs compressed-tensors' fake_quantize with the folder's args on bf16 activations: every
    value it gives is bf16((q - z) * s), the bf16 scale times a code on the grid, rounded once to bf16, and the
    codes span the grid's range."""
    q, batches = _quantized(recipe)
    low = precision.in_dtype(q, torch.bfloat16)
    seen = {}
    low.model.taps["input"].register_forward_hook(lambda m, a, out: seen.setdefault("x", out))
    with torch.no_grad():
        low(batches[0].to(torch.bfloat16))
    r = low.ranges["input"]
    x = seen["x"]
    assert x.dtype == torch.bfloat16
    t = x.float() / r.scale
    # the code each value came from is the floor or the ceiling of x / s (bf16's rounding moves it < 1 step)
    on_grid = torch.zeros_like(t, dtype=torch.bool)
    for k in (torch.floor(t), torch.ceil(t)):
        on_grid |= (k * r.scale).to(torch.bfloat16) == x
    assert bool(on_grid.all())
    codes = torch.round(t)
    assert codes.min() >= r.qmin - r.zero_point - 1 and codes.max() <= r.qmax - r.zero_point + 1
    assert codes.max() - codes.min() > 64  # the calibrated range is used, not a few codes


@pytest.mark.hf
def test_auto_is_the_checkpoints_dtype_for_compressed_tensors_and_float32_for_onnx(tmp_path):
    from types import SimpleNamespace

    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.bfloat16),
               "c": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    info = SimpleNamespace(path=tmp_path, weights_format="safetensors")
    assert precision.resolve_compute_dtype("auto", "compressed-tensors", info) is torch.bfloat16
    assert precision.resolve_compute_dtype("auto", "onnx", info) is torch.float32
    assert precision.resolve_compute_dtype("float32", "compressed-tensors", info) is torch.float32
    with pytest.raises(FFNQuantError, match="the onnx graph computes in float32; valid for onnx: auto, float32"):
        precision.resolve_compute_dtype("bfloat16", "onnx", info)
