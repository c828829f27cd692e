"""The built-in method handlers: round-to-nearest (float, fp8, integer grids), bitsandbytes' code books, GPTQ,
HQQ and AWQ. Each is bit-identical to the numerics ffnquant has always measured; a new method is a file like
this one (a `MethodHandler` subclass and `register_method`) plus its Scheme preset."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from ..errors import FFNQuantError
from ..numerics import primitives as P
from .qlinear import QuantizedLinear, WeightGrid, signed_zero_point
from .registry import MethodHandler, register_method

if TYPE_CHECKING:  # annotations only
    from ..schemes import Scheme

__all__ = ["RoundToNearest", "BitsAndBytes4", "GPTQ", "HQQ", "AWQ"]


def _group(scheme: Scheme, w: torch.Tensor) -> int:
    """The group width of a 4-bit grid: the scheme's group, or the whole input (per channel as one group)."""
    return scheme.group_size if str(scheme.weight_granularity) == "per_group" else w.shape[1]


def int4_linear(w: torch.Tensor, scheme: Scheme, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor,
                group: int) -> QuantizedLinear:
    """A QuantizedLinear from MatMulNBits-style codes 0..15 [out, K'] with scale / zero point [out, K'/g, 1]."""
    deq = P.int4_group_dequantize(q, scale, zp, w.shape[1])
    grid = WeightGrid("int", 4, str(scheme.weight_granularity), scheme.weight_symmetric, scale[..., 0],
                      signed_zero_point(zp[..., 0], 4, True), group)
    return QuantizedLinear(deq, scheme, grid, (q - 8).to(torch.int32))


class RoundToNearest(MethodHandler):
    """Round to nearest on the scheme's grid: float casts, fp8 e4m3 scales, int8 / int4 integer grids."""

    method = "rtn"
    describe = "round-to-nearest"

    def quantize(self, weight: torch.Tensor, scheme: Scheme, hessian: torch.Tensor | None = None) -> QuantizedLinear:
        wd, gran = str(scheme.weight_dtype), str(scheme.weight_granularity)
        w = weight.detach().float()
        if wd == "fp32":
            return QuantizedLinear(w.clone(), scheme)
        if wd in ("fp16", "bf16"):
            return QuantizedLinear(w.to(torch.float16 if wd == "fp16" else torch.bfloat16).float(), scheme)
        if wd == "fp8_e4m3":
            amax = w.abs().max() if gran == "per_tensor" else w.abs().amax(dim=1, keepdim=True)
            deq = P.fp8_weight_fake(w, gran)
            scale = torch.where(amax > 0, amax / P.FP8_E4M3_MAX, torch.ones_like(amax))  # as fp8_e4m3_fake uses it
            # the e4m3 codes fp8_e4m3_fake rounds to (saturating at +-448): what an fp8 GEMM multiplies
            codes = torch.clamp(w / scale, -P.FP8_E4M3_MAX, P.FP8_E4M3_MAX).to(torch.float8_e4m3fn)
            return QuantizedLinear(deq, scheme, WeightGrid("fp8", 8, gran, True, scale, None), codes)
        bits = 8 if wd == "int8" else 4
        if bits == 4 and gran != "per_tensor":
            # MatMulNBits' grid (per-channel = one group spanning the whole input); a group that does not divide
            # the input width pads it with zero columns (primitives._pad_columns)
            g = _group(scheme, w)
            return int4_linear(w, scheme, *P.int4_group_rtn(w, g, scheme.weight_symmetric), g)
        # a signed grid (asymmetric: unsigned), as primitives.fake_quantize_weight
        symmetric = scheme.weight_symmetric
        qmin, qmax = P.int_range(bits, signed=symmetric)
        deq = P.fake_quantize_weight(w, gran, bits, symmetric, scheme.group_size)
        scale, zp = P.weight_qparams(w, gran, qmin, qmax, symmetric, scheme.group_size)
        if gran == "per_group":
            wg = P._groups(w, scheme.group_size)
            codes = P.quantize(wg, scale, zp, qmin, qmax).reshape(w.shape[0], -1)
            scale, zp = scale[..., 0], zp[..., 0]
        else:
            codes = P.quantize(w, scale, zp, qmin, qmax)
        shift = 0 if symmetric else 1 << (bits - 1)
        grid = WeightGrid("int", bits, gran, symmetric, scale, signed_zero_point(zp, bits, not symmetric),
                          scheme.group_size)
        return QuantizedLinear(deq, scheme, grid, (codes - shift).to(torch.int32))


class BitsAndBytes4(MethodHandler):
    """bitsandbytes' nf4 / fp4: block-wise absmax over a fixed code book, quantized by bitsandbytes itself."""

    method = "rtn"
    on_grid = False
    describe = "bitsandbytes' block-wise absmax code book"

    def accepts(self, scheme: Scheme) -> bool:
        return str(scheme.weight_dtype) in ("nf4", "fp4")

    def quantize(self, weight: torch.Tensor, scheme: Scheme, hessian: torch.Tensor | None = None) -> QuantizedLinear:
        packed, absmax, deq = P.bnb_4bit_codes(weight.detach().float(), str(scheme.weight_dtype), scheme.group_size)
        # the code book's packed codes and block absmax as bitsandbytes stores them (MatMulBnb4 reads the same)
        return QuantizedLinear(deq, scheme, None, packed, scale_float=absmax)


class GPTQ(MethodHandler):
    """GPTQ (Hessian-aware rounding, column by column) on the int4 group grid of round-to-nearest."""

    method = "gptq"
    needs_hessians = True
    describe = "GPTQ"

    def check(self, scheme: Scheme) -> str | None:
        return None if str(scheme.weight_dtype) == "int4" else "gptq applies to int4 weights (MatMulNBits' group grid)"

    def quantize(self, weight: torch.Tensor, scheme: Scheme, hessian: torch.Tensor | None = None) -> QuantizedLinear:
        if hessian is None:
            raise FFNQuantError(f"scheme {scheme.name!r} (gptq) needs calibration data for the input Hessians")
        w = weight.detach().float()
        g = _group(scheme, w)
        return int4_linear(w, scheme, *P.gptq_int4_codes(w, hessian, g, scheme.weight_symmetric), g)


class HQQ(MethodHandler):
    """HQQ: int4 codes with fitted float zero points (onnxruntime's copy of the HQQ routine)."""

    method = "hqq"
    on_grid = False  # float zero points: no integer grid a deployment format stores
    describe = "HQQ-fitted zero points"

    def check(self, scheme: Scheme) -> str | None:
        if str(scheme.weight_dtype) != "int4" or scheme.weight_symmetric:
            return "hqq fits a zero point: int4 weights, asymmetric"
        return None

    def quantize(self, weight: torch.Tensor, scheme: Scheme, hessian: torch.Tensor | None = None) -> QuantizedLinear:
        w = weight.detach().float()
        q, scale, zero = P.hqq_int4_codes(w, _group(scheme, w))
        deq = P.int4_group_dequantize(q, scale.unsqueeze(-1), zero.unsqueeze(-1), w.shape[1])
        return QuantizedLinear(deq, scheme, None, q.to(torch.int32), zero_float=zero, scale_float=scale)


class AWQ(MethodHandler):
    """AWQ: activation-aware channel scales searched on calibration data and folded into the FFN (an exact float
    rewrite, `awq.awq_fold`), AutoAWQ's clipping, then round-to-nearest of the scaled weights."""

    method = "awq"
    needs_hessians = True
    describe = ("AWQ (activation-aware channel scales searched on calibration data and folded into the FFN, then "
                "round-to-nearest)")

    def check(self, scheme: Scheme) -> str | None:
        if str(scheme.weight_dtype) != "int4" or str(scheme.weight_granularity) == "per_tensor":
            return "awq applies to int4 weights, per_group or per_channel"
        if not scheme.act_dtype.is_float:
            # the fold rescales the matmul inputs, so ranges calibrated on the unfolded model would not fit
            return "awq is weight-only (float activations): its fold rescales the activations after calibration"
        return None

    def fold(self, model: Any, scheme: Scheme, hessians: Mapping[str, Any] | None, weights: list[str],
             cache: dict | None = None) -> tuple[Any, list]:
        from .awq import awq_fold, clip_weights

        if hessians is None:
            raise FFNQuantError(f"scheme {scheme.name!r} (awq) needs calibration data for the input Hessians")
        # the search depends on the model, its Hessians and the scheme's grid only, not on which weights are then
        # rounded: `-awq` and `-awq+float=hidden` share it
        key = ("awq", scheme)
        if cache is None or key not in cache:
            found = awq_fold(model, hessians, scheme)
            if cache is not None:
                cache[key] = found
        new, record = found if cache is None else cache[key]
        return clip_weights(new, record, weights), [record]  # AutoAWQ's clipping of the weights about to be rounded

    def quantize(self, weight: torch.Tensor, scheme: Scheme, hessian: torch.Tensor | None = None) -> QuantizedLinear:
        return _RTN.quantize(weight, scheme)


_RTN = register_method(RoundToNearest())
register_method(BitsAndBytes4(), first=True)
register_method(GPTQ())
register_method(HQQ())
register_method(AWQ())
