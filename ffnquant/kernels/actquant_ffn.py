"""Whole-FFN modules on the fused activation quantization kernels (`actquant`), int8 and fp8, gated and dense.

One forward is: quantize_rows(x) -> one GEMM for gate and up together ([Wg; Wu] as one weight) -> the fused
act(g) * u + quantize (`act_mul_quantize`) -> the down GEMM -> `rescale_int8` (int8) or `_scaled_mm`'s own
row-wise scaled epilogue (fp8). Dense (ungated) FFNs take the same path with act(up) as the hidden. Weights
are quantized exactly as torch_rt's `Int8DynamicLinear` / `Fp8RowwiseLinear` quantize them, and every
activation is quantized and rounded as the unfused path (those modules per Linear, `torch_rt.unfused_ffn`) does, so
outputs are the same bit for bit up to the activation function's float32 evaluation and, on fp8, the float
summation order of the GEMM over the concatenated weight.
"""

from __future__ import annotations

import copy

import torch

from ..errors import FFNQuantError, unknown_choice
from ..methods import quantize_linear
from ..schemes import get_scheme
from .actquant import (
    KINDS,
    _check_device,
    _launch_hidden,
    _launch_rescale,
    _launch_rows,
)
from .w4a16_pack import KeptDtypes, describe

__all__ = [
    "FusedFp8DenseFFN",
    "FusedFp8GatedFFN",
    "FusedInt8DenseFFN",
    "FusedInt8GatedFFN",
    "fused_ffn",
]

_MULTIPLE = {"int8": 8, "fp8": 16}  # cuBLAS int8 / cuBLASLt fp8 dimension multiples
# the preset whose weights each kind's GEMMs take (per output row), and the codes' storage dtype
_WEIGHT_SCHEME = {"int8": "w8a8-dynamic-s8", "fp8": "fp8-e4m3-dynamic"}
_CODE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _linears(model, gated: bool) -> tuple[list, torch.nn.Linear]:
    spec = getattr(model, "spec", None)
    if spec is None or not hasattr(model, "w_up") or not hasattr(model, "w_down"):
        raise FFNQuantError(f"a fused FFN wraps an ffnquant FFN (model.FFN), got {type(model).__name__}")
    if bool(spec.gated) != gated:
        want, got = ("gated", "dense") if gated else ("dense", "gated")
        raise FFNQuantError(f"this module takes a {want} FFN, got the {got} {spec.variant.value}; "
                            "use fused_ffn(model, kind)")
    if not isinstance(getattr(model, "hidden_transform", torch.nn.Identity()), torch.nn.Identity):
        raise FFNQuantError("the fused hidden epilogue cannot apply a hidden_transform; fold it into w_down first")
    ins = [model.w_gate, model.w_up] if gated else [model.w_up]
    return ins, model.w_down


class _FusedQuantFFN(KeptDtypes):
    # codes, scales and biases keep their dtypes through .half() / .to(dtype): the numerics of record
    kept_dtypes = ("w_in", "w_out", "s_in", "s_out", "b_in", "b_out")
    kind = ""
    gated = True

    def __init__(self, model, device=None) -> None:
        super().__init__()
        ins, down = _linears(model, self.gated)
        spec = model.spec
        self.d_model, self.d_ff, self.act = spec.d_model, spec.d_ff, spec.activation.value
        mult = _MULTIPLE[self.kind]
        if self.d_model % mult or self.d_ff % mult:
            raise FFNQuantError(f"the {self.kind} GEMMs need d_model and d_ff divisible by {mult}, "
                                f"got {self.d_model} and {self.d_ff}")
        dev = torch.device(device) if device is not None else down.weight.device
        # weights quantized from float32 on the CPU by the preset's method handler, as torch_rt's modules are (per
        # output row: quantizing the concatenation [Wg; Wu] gives each matrix's own codes and scales)
        scheme = get_scheme(_WEIGHT_SCHEME[self.kind])
        w_in = quantize_linear(torch.cat([lin.weight.detach().float().cpu() for lin in ins]), scheme)
        w_down = quantize_linear(down.weight.detach().float().cpu(), scheme)
        q_in, s_in = w_in.codes.to(_CODE_DTYPE[self.kind]), w_in.grid.scale.float()
        q_out, s_out = w_down.codes.to(_CODE_DTYPE[self.kind]), w_down.grid.scale.float()
        self.register_buffer("w_in", q_in.to(dev))  # [F or 2F, d], row-major: .t() is the GEMM's column-major mat2
        self.register_buffer("w_out", q_out.to(dev))
        shape = (-1,) if self.kind == "int8" else (1, -1)  # _scaled_mm takes scale_b as [1, N]
        self.register_buffer("s_in", s_in.reshape(shape).contiguous().to(dev))
        self.register_buffer("s_out", s_out.reshape(shape).contiguous().to(dev))
        self.register_buffer("b_in", _bias(ins, dev))
        self.register_buffer("b_out", _bias([down], dev))
        it = getattr(model, "input_transform", None)
        self.input_transform = None if it is None or isinstance(it, torch.nn.Identity) else copy.deepcopy(it).to(dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d_model] in float16, bfloat16 or float32 -> the FFN output, same shape and dtype."""
        if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES or x.dim() < 1 or x.shape[-1] != self.d_model:
            raise FFNQuantError(f"the fused FFN takes x [..., {self.d_model}] in float16, bfloat16 or float32, "
                                f"got {describe(x)}")
        if self.input_transform is not None:
            x = self.input_transform(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.d_model)
        if x2.shape[0] == 0:
            return torch.zeros_like(x)
        _check_device(x2, "the fused FFN")
        hq, hs = self.hidden(x2)
        return self.down(hq, hs, x2.shape[0], x.dtype).reshape(*lead, self.d_model)

    def hidden(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The down projection's input: (codes [R, d_ff], float32 scales [R, 1]), R >= rows of x2d (padding)."""
        raise NotImplementedError

    def down(self, hq: torch.Tensor, hs: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The down projection of quantized hidden rows: [rows, d_model] in `dtype`."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, gated={self.gated}, d_model={self.d_model}, d_ff={self.d_ff}, act={self.act}, "
                f"bias={self.b_in is not None}")


class _Int8(_FusedQuantFFN):
    """w8a8-dynamic-s8: per-token symmetric int8 activations, per-channel int8 weights, `torch._int_mm`."""

    kind = "int8"
    min_rows: int | None = None  # GEMM rows at least; None: 17 on CUDA (cuBLAS int8 needs more than 16), else 0

    def hidden(self, x2d):
        m = x2d.shape[0]
        pad = self.min_rows if self.min_rows is not None else (17 if x2d.is_cuda else 0)  # as Int8DynamicLinear pads
        xq, xs = _launch_rows(x2d, False, max(m, pad))
        acc = torch._int_mm(xq, self.w_in.t())
        return _launch_hidden(acc, False, self.act, self.gated, xs, self.s_in, self.b_in, m, x2d.dtype, max(m, pad))

    def down(self, hq, hs, rows, dtype):
        return _launch_rescale(torch._int_mm(hq, self.w_out.t()), hs, self.s_out, self.b_out, rows, dtype)


class _Fp8(_FusedQuantFFN):
    """fp8-e4m3-dynamic: per-token e4m3 activations, per-channel e4m3 weights, `torch._scaled_mm` row-wise."""

    kind = "fp8"

    def hidden(self, x2d):
        # rows padded to 16 by the kernels (cuBLASLt's fp8 GEMM wants every dimension a multiple of 16)
        m = x2d.shape[0]
        rows = -(-m // 16) * 16
        xq, xs = _launch_rows(x2d, True, rows)
        y = _scaled_mm(xq, self.w_in, xs, self.s_in)
        return _launch_hidden(y, True, self.act, self.gated, None, None, self.b_in, m, x2d.dtype, rows)

    def down(self, hq, hs, rows, dtype):
        y = _scaled_mm(hq, self.w_out, hs, self.s_out)[:rows]
        if dtype != y.dtype:
            y = y.to(dtype)
        # the bias after the bf16 GEMM output, in the activation dtype, as Fp8RowwiseLinear adds it
        return y if self.b_out is None else y + self.b_out.to(dtype)


class FusedInt8GatedFFN(_Int8):
    """A gated FFN (swiglu, geglu, ...) in w8a8-dynamic-s8 numerics on the fused kernels: `FusedInt8GatedFFN(model)`."""


class FusedInt8DenseFFN(_Int8):
    """A dense (ungated) FFN in w8a8-dynamic-s8 numerics on the fused kernels: the hidden is act(up)."""

    gated = False


class FusedFp8GatedFFN(_Fp8):
    """A gated FFN in fp8-e4m3-dynamic numerics on the fused kernels: `FusedFp8GatedFFN(model)`."""


class FusedFp8DenseFFN(_Fp8):
    """A dense (ungated) FFN in fp8-e4m3-dynamic numerics on the fused kernels."""

    gated = False


_CLASSES = {("int8", True): FusedInt8GatedFFN, ("int8", False): FusedInt8DenseFFN,
            ("fp8", True): FusedFp8GatedFFN, ("fp8", False): FusedFp8DenseFFN}


def fused_ffn(model, kind: str, device=None) -> _FusedQuantFFN:
    """The fused module for `model` (gated or dense) in `kind` ("int8": w8a8-dynamic-s8, "fp8": fp8-e4m3-dynamic)."""
    if kind not in KINDS:
        raise unknown_choice("activation quantization kind", kind, KINDS)
    spec = getattr(model, "spec", None)
    if spec is None:
        raise FFNQuantError(f"a fused FFN wraps an ffnquant FFN (model.FFN), got {type(model).__name__}")
    return _CLASSES[kind, bool(spec.gated)](model, device)


def _scaled_mm(a, w, sa, sw):
    y = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)  # row-wise: bf16 out
    return y[0] if isinstance(y, tuple) else y  # torch 2.4 returned (out, amax)


def _bias(linears, dev):
    if linears[0].bias is None:
        return None
    return torch.cat([lin.bias.detach().float().cpu() for lin in linears]).to(dev)

