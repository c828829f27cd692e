"""A quantized FFN as its runtime computes it in the checkpoint's own low precision (bf16, fp16).

A compressed-tensors folder of a bf16 model is served in bf16: transformers (and vLLM) load every parameter in
the model's dtype, the stored scales included; each quantized weight is decompressed as (code - zero) * scale,
computed in bf16; each quantized input is fake-quantized by compressed-tensors itself on the bf16 activations
(static: x / s + z, rounded and clamped, then (q - z) * s, each step in bf16; per token: the scale it computes
from the token, absmax / 127.5); every matmul, activation function and product runs in bf16.

`in_dtype(qffn, dtype)` is that computation of one ffnquant QuantizedFFN:
- every weight grid's scale and every static input scale is rounded to `dtype` and the codes are kept, so the
  folder stores the scales in `dtype` without loss and decompresses to exactly the weights computed here
  ((code - zero) * scale is exact in float32 for 8-bit codes and a 16-bit scale; one rounding to `dtype`);
- the FFN's parameters are in `dtype`, so its forward computes in it;
- the input quantizers are compressed-tensors' own functions (`fake_quantize`, `compute_dynamic_scales_and_zp`)
  with the QuantizationArgs the folder is written with (`input_args`, which `ctensors.module_args` uses too),
  not a copy of them.

float32 gives the QuantizedFFN back unchanged: ffnquant's own numerics, which the float32 proof checks.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ..errors import FFNQuantError, unknown_choice
from ..hf.checkpoint import _Weights
from ..model import FFN
from ..methods.fakequant import QuantizedFFN, SiteRange, WeightGrid
from ..schemes import ActMode

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..schemes import Scheme

__all__ = ["COMPUTE_DTYPES", "compute_dtype", "dtype_name", "rounding_step", "input_args", "in_dtype", "in_dtype_all",
           "source_dtype", "resolve_compute_dtype"]

COMPUTE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def compute_dtype(name: str | torch.dtype) -> torch.dtype:
    """A compute dtype by name (float32, bfloat16, float16; bf16, fp16, fp32 too); an unknown one lists them."""
    if isinstance(name, torch.dtype):
        if name not in COMPUTE_DTYPES.values():
            raise unknown_choice("compute dtype", str(name), COMPUTE_DTYPES)
        return name
    key = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(str(name).strip().lower(),
                                                                        str(name).strip().lower())
    if key not in COMPUTE_DTYPES:
        raise unknown_choice("compute dtype", name, COMPUTE_DTYPES)
    return COMPUTE_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16', 'float16'."""
    return str(dtype).removeprefix("torch.")


def rounding_step(dtype: torch.dtype) -> float:
    """One step of `dtype`'s rounding at 1 (its machine epsilon: 2^-23 for float32, 2^-7 for bf16): the
    smallest relative change of an input that every computation in `dtype` sees."""
    return float(torch.finfo(dtype).eps)


def source_dtype(info: ModelInfo) -> torch.dtype:
    """The floating dtype most of the source checkpoint's tensors are stored in (float32 for a pickled one)."""
    from collections import Counter

    if info.weights_format != "safetensors":
        return torch.float32
    weights = _Weights(info.path, False)
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}
    counts = Counter(names.get(str(weights.dtype(n))) for n in weights.file_of)
    counts.pop(None, None)
    return counts.most_common(1)[0][0] if counts else torch.float32


def resolve_compute_dtype(name: str, fmt: str | None, info: ModelInfo) -> torch.dtype:
    """The dtype a deployed model of `info` computes in, for `--compute-dtype name` and format `fmt` (None: not
    said): "auto" is the checkpoint's own dtype for compressed-tensors (bf16 checkpoints are served in bf16) and
    float32 otherwise; onnx graphs compute in float32 (onnxruntime's CPU kernels), the only one they take. A low
    precision runs compressed-tensors' input quantizers (`in_dtype`), so it needs that library."""
    if str(name).strip().lower() == "auto":
        dtype = source_dtype(info) if fmt == "compressed-tensors" else torch.float32
    else:
        dtype = compute_dtype(name)
    if fmt == "onnx" and dtype is not torch.float32:
        raise FFNQuantError(f"compute dtype {dtype_name(dtype)}: the onnx graph computes in float32; valid for onnx: "
                            "auto, float32")
    if dtype is not torch.float32:
        try:
            import compressed_tensors  # noqa: F401
        except ImportError:
            raise FFNQuantError(f"compute dtype {dtype_name(dtype)}: a quantized FFN computed as its runtime does in "
                                "it uses compressed-tensors' quantizers, which are not installed (pip install "
                                "'ffnquant[deploy]'); valid without it: float32") from None
    return dtype


def _expand(t: torch.Tensor, grid: WeightGrid, shape: torch.Size) -> torch.Tensor:
    """A grid's per-tensor, per-channel or per-group tensor spread over the [out, in] weight."""
    if t.dim() == 0:
        return t.expand(shape)
    if t.shape[-1] == 1:
        return t.reshape(t.shape[0], 1).expand(shape)
    return t.repeat_interleave(int(grid.group_size), dim=1)[:, :shape[1]]


def _crop(codes: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Codes [out, K'] (a group grid's padded columns) cropped to the weight's [out, in]."""
    return codes[:, : shape[1]]


def _rounded_grid(w: torch.Tensor, grid: WeightGrid, dtype: torch.dtype,
                  int_codes: torch.Tensor | None = None) -> tuple[torch.Tensor, WeightGrid]:
    """(weight in `dtype`, grid) with the grid's scale rounded to `dtype` and the codes of `w` kept: `int_codes`
    (the method handler's, `QuantizedLinear.codes`) where given, else read off `w` on its grid."""
    scale = grid.scale.float()
    low = scale.to(dtype).float()
    s, s_low = _expand(scale, grid, w.shape), _expand(low, grid, w.shape)
    if grid.kind == "fp8":
        codes = (w.float() / s).to(torch.float8_e4m3fn).float()  # the e4m3 values w was rounded to
    elif int_codes is not None:
        zp = grid.zero_point if grid.zero_point is not None else torch.zeros_like(scale, dtype=torch.int32)
        codes = (_crop(int_codes, w.shape) - _expand(zp.float(), grid, w.shape)).float()
    else:
        zp = grid.zero_point if grid.zero_point is not None else torch.zeros_like(scale, dtype=torch.int32)
        z = _expand(zp.float(), grid, w.shape)
        codes = torch.round(w.float() / s + z) - z  # code - zero: an exact small integer
    # (code - zero) * scale: exact in float32 (8-bit codes, 8- or 11-bit scales), then one rounding to dtype,
    # as compressed-tensors decompresses it in the model's dtype
    return (codes * s_low).to(dtype), dataclasses.replace(grid, scale=low.reshape(grid.scale.shape))


def _rounded_range(r: SiteRange, dtype: torch.dtype) -> SiteRange:
    return dataclasses.replace(r, scale=float(torch.tensor(r.scale, dtype=torch.float32).to(dtype)))


def input_args(scheme: Scheme, mode: str | None, rng: SiteRange | None) -> Any:
    """compressed-tensors' QuantizationArgs of a matmul's input quantized under `scheme`: `mode` "dynamic" (per
    token) or "static" (one calibrated range `rng`); None for a float input."""
    from compressed_tensors.quantization import QuantizationArgs

    if mode is None:
        return None
    fp8 = scheme.act_dtype.value == "fp8_e4m3"
    if mode == "dynamic":
        return QuantizationArgs(num_bits=8, type="float" if fp8 else "int",
                                symmetric=True if fp8 else bool(scheme.act_symmetric), strategy="token", dynamic=True)
    symmetric = fp8 or (rng.qmin == -128 and rng.zero_point == 0)
    return QuantizationArgs(num_bits=8, type="float" if fp8 else "int", symmetric=symmetric, strategy="tensor",
                            dynamic=False)


def _input_quantizer(scheme: Scheme, rng: SiteRange | None, dtype: torch.dtype):
    """compressed-tensors' fake quantization of one input site, as the folder's module runs it on `dtype` inputs."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    if scheme.act_dtype.is_float:
        return None
    args = input_args(scheme, "dynamic" if scheme.act_mode is ActMode.DYNAMIC else "static", rng)
    if args.dynamic:
        def dynamic(x: torch.Tensor) -> torch.Tensor:
            scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=None)
            return fake_quantize(x, scale, zp, args)
        return dynamic
    scale = torch.tensor([rng.scale], dtype=dtype)
    zp = None
    if not args.symmetric:  # ffnquant's uint8 grid 0..255 is compressed-tensors' int8 grid shifted by 128
        zp = torch.tensor([rng.zero_point - 128 if rng.qmin == 0 else rng.zero_point], dtype=torch.int8)
    return lambda x: fake_quantize(x, scale, zp, args)


def in_dtype(qffn: QuantizedFFN, dtype: torch.dtype) -> Any:
    """`qffn` (a QuantizedFFN) as a compressed-tensors runtime computes it in `dtype` (see the module docstring);
    float32 returns `qffn` itself. The copy's grids and ranges carry the rounded scales the folder stores."""
    if dtype is torch.float32:
        return qffn
    if hasattr(qffn, "qffns") and hasattr(qffn, "replacements"):  # a layer of routed experts (`planning.moe`)
        out = copy.copy(qffn)
        out.qffns = {expert: in_dtype(q, dtype) for expert, q in qffn.qffns.items()}
        return out
    if not isinstance(qffn, QuantizedFFN):
        raise FFNQuantError(f"cannot compute {type(qffn).__name__} in {dtype_name(dtype)}: a QuantizedFFN is needed")
    src = qffn.model
    grids: dict[str, WeightGrid] = {}
    weights: dict[str, torch.Tensor] = {}
    linears = {}
    with torch.no_grad():
        for name in src.spec.weight_names:
            w = getattr(src, name).weight
            if name in qffn.weight_grids:
                ql = qffn.linears.get(name)
                weights[name], grids[name] = _rounded_grid(w, qffn.weight_grids[name], dtype,
                                                           None if ql is None else ql.codes)
                if ql is not None:  # the same codes on the rounded grid, and the weight the FFN computes with (in
                    # `dtype`: a float32 copy beside it was a sixth of a whole-model export's peak)
                    linears[name] = dataclasses.replace(ql, weight=weights[name], grid=grids[name])
            else:
                weights[name] = w.to(dtype)
        state = {f"{name}.weight": w.contiguous() for name, w in weights.items()}
        state.update({f"{name}.bias": getattr(src, name).bias.to(dtype) for name in weights
                      if getattr(src, name).bias is not None})
        own = src.own_activation()  # the model's own activation module computes in `dtype` too
        # where `src` is (the verification engine's device)
        ffn = FFN.from_state(src.spec, state, dtype, activation=None if own is None else own.to(dtype))
    ffn.input_transform = copy.deepcopy(src.input_transform)  # each casts to its input's dtype
    ffn.hidden_transform = copy.deepcopy(src.hidden_transform)
    ranges = {site: _rounded_range(r, dtype) for site, r in qffn.ranges.items()}
    out = QuantizedFFN(ffn.eval(), qffn.scheme, ranges, qffn.quantized_weights, (), qffn.remedies, grids, linears)
    out.quantized_sites = tuple(qffn.quantized_sites)
    for site in out.quantized_sites:
        fn = _input_quantizer(qffn.scheme, ranges.get(site), dtype)
        if fn is not None:
            out._handles.append(ffn.taps[site].register_forward_hook(lambda mod, inp, o, fn=fn: fn(o)))
    out.recipe, out.prepared = qffn.recipe, qffn.prepared
    return out


def in_dtype_all(qffns: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """`in_dtype` of every quantized FFN, by label."""
    return {label: in_dtype(q, dtype) for label, q in qffns.items()}
