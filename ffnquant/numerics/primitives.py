"""Quantization math as pure functions on torch tensors: qparams, (de)quantize, packing, formats.

Conventions (shared by the torch reference and the ONNX artifacts, so they agree):
- affine: q = clamp(round_half_even(x / scale) + zero_point, qmin, qmax); x' = (q - zp) * scale;
  the range always contains 0, so zero is exact (padding, ReLU zeros).
- symmetric: zero point at the middle of the grid (0 for signed, 128 for uint8) and
  scale = absmax / (qmax - zp): int8 uses [-127, 127] in practice, -128 only by clamping.
- group-wise int4 follows onnxruntime's MatMulNBits quantizer (MLAS): groups of `group_size`
  consecutive input features; symmetric maps the group's signed extreme to -8 (all 16 levels
  used, scale may be negative); asymmetric spans [min(lo, 0), max(hi, 0)] over 0..15.
- any group size fits any width: the input dimension K is padded with zero columns up to
  ceil(K / g) * g (the last group holds K mod g real columns), as MatMulNBits stores it. The
  group quantizers return codes of the padded shape [out, ceil(K/g)*g] and scales / zero points
  [out, ceil(K/g), 1]; dequantized weights are cropped back to [out, K]. For K divisible by g
  nothing is padded and every number is what it was.
"""

from __future__ import annotations

import torch

from ..errors import FFNQuantError
from ..infra.thirdparty import matmul_nbits_quantizer, quiet_bitsandbytes

__all__ = [
    "FP8_E4M3_MAX",
    "all_finite",
    "int_range",
    "choose_qparams",
    "quantize",
    "dequantize",
    "fake_quantize",
    "weight_qparams",
    "fake_quantize_weight",
    "pack_int4",
    "unpack_int4",
    "padded_width",
    "int4_group_rtn",
    "int4_group_dequantize",
    "hqq_int4",
    "gptq_int4",
    "gptq_int4_codes",
    "fp8_e4m3_fake",
    "fp8_weight_fake",
    "fake_quantize_per_token",
    "fp8_per_token_fake",
    "bnb_4bit_fake",
    "int8_symmetric_rows",
    "fp8_rowwise",
    "fp8_tensorwise",
]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of `x` is finite: one min/max reduction (NaN and infinities propagate to it), not a
    boolean tensor the size of `x` (30x faster on an 8B model's FFN matrices)."""
    if x.numel() == 0 or not (x.is_floating_point() or x.is_complex()):
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def int_range(bits: int, signed: bool) -> tuple[int, int]:
    """(qmin, qmax) of a `bits`-bit integer grid."""
    if bits < 2 or bits > 16:
        raise FFNQuantError(f"bits must be in 2..16, got {bits}")
    if signed:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def choose_qparams(
    lo: torch.Tensor | float, hi: torch.Tensor | float, qmin: int, qmax: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (positive, float32) and integer zero point (int32) mapping [lo, hi] (widened to hold 0) onto [qmin, qmax]."""
    lo = torch.as_tensor(lo, dtype=torch.float32)
    hi = torch.as_tensor(hi, dtype=torch.float32)
    lo = torch.minimum(lo, torch.zeros_like(lo))
    hi = torch.maximum(hi, torch.zeros_like(hi))
    # A scale below float32's smallest normal number is subnormal: x / scale and q * scale then lose
    # most of their bits and the half-step error bound fails. Such a range is represented on the
    # smallest normal step instead; an all-zero range on any positive scale (1).
    tiny = torch.finfo(torch.float32).tiny

    def usable(scale: torch.Tensor) -> torch.Tensor:
        return torch.where(scale > 0, torch.clamp(scale, min=tiny), torch.ones_like(scale))

    if symmetric:
        zp = (qmin + qmax + 1) // 2
        absmax = torch.maximum(-lo, hi)
        scale = usable(absmax / float(qmax - zp))
        zero_point = torch.full_like(scale, zp, dtype=torch.int32)
    else:
        scale = usable((hi - lo) / float(qmax - qmin))
        zero_point = torch.clamp(torch.round(qmin - lo / scale), qmin, qmax).to(torch.int32)
    return scale, zero_point


def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Integer codes (int32) of x; torch.round is round-half-to-even like onnx QuantizeLinear."""
    return torch.clamp(torch.round(x / scale) + zero_point, qmin, qmax).to(torch.int32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """Float values (float32) of integer codes."""
    return (q.to(torch.float32) - zero_point.to(torch.float32)) * scale


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype (computed in float32 throughout: codes are exact integers there)."""
    zp = zero_point.to(torch.float32)
    q = torch.div(x.float(), scale)
    if x.requires_grad or torch.broadcast_shapes(q.shape, zp.shape) != q.shape:
        q = torch.clamp(torch.round(q) + zp, qmin, qmax)
        return ((q - zp) * scale).to(x.dtype)
    # the same operations in place on one temporary (a weight-sized tensor, not three): bit-identical results, and
    # a streamed layer's quantization peaks lower (benchmarks/scale.py)
    return q.round_().add_(zp).clamp_(qmin, qmax).sub_(zp).mul_(scale).to(x.dtype)


def weight_qparams(
    w: torch.Tensor, granularity: str, qmin: int, qmax: int, symmetric: bool, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max qparams of a [out, in] weight: shape [] (per_tensor), [out, 1] (per_channel) or [out, ceil(in/g), 1] (per_group)."""
    w = w.detach().float()
    g = str(getattr(granularity, "value", granularity))
    if g == "per_tensor":
        lo, hi = w.min(), w.max()
    elif g == "per_channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    elif g == "per_group":
        wg = _groups(w, group_size)
        lo, hi = wg.amin(dim=2, keepdim=True), wg.amax(dim=2, keepdim=True)
    else:
        raise FFNQuantError(f"unknown granularity {granularity!r}; valid: per_tensor, per_channel, per_group")
    return choose_qparams(lo, hi, qmin, qmax, symmetric)


def padded_width(in_features: int, group_size: int) -> int:
    """The input dimension padded up to whole groups: ceil(in / g) * g."""
    return -(-in_features // group_size) * group_size


def _pad_columns(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[out, in] -> [out, ceil(in/g)*g] with zero columns appended (the tensor itself when g divides in).

    Zero columns, not copies of the group's values: every min/max grid here contains 0
    (`choose_qparams` widens [lo, hi] to hold 0, the int4 grids span [min(lo, 0), max(hi, 0)] or
    the signed absmax extreme), so a zero never moves a group's min, max or absmax: the last,
    partial group's scale and zero point come from its real columns only. Zero columns also
    quantize to the zero point exactly, so the padded weights are exactly 0 (as in the artifact).
    HQQ's fit is the exception (its range is not widened to 0): see `hqq_int4`.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise FFNQuantError(f"group size must be a positive integer, got {group_size!r}")
    pad = padded_width(w.shape[1], group_size) - w.shape[1]
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def _groups(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[out, in] -> [out, ceil(in/g), g], zero-padded along `in` (see `_pad_columns`)."""
    wp = _pad_columns(w, group_size)
    return wp.reshape(wp.shape[0], wp.shape[1] // group_size, group_size)


def fake_quantize_weight(
    w: torch.Tensor, granularity: str, bits: int, symmetric: bool, group_size: int | None = None
) -> torch.Tensor:
    """Round-to-nearest fake quantization of a [out, in] weight on a signed `bits` grid (asymmetric: unsigned)."""
    qmin, qmax = int_range(bits, signed=symmetric)
    scale, zp = weight_qparams(w, granularity, qmin, qmax, symmetric, group_size)
    g = str(getattr(granularity, "value", granularity))
    wf = w.detach().float()
    if g == "per_group":
        wq = fake_quantize(_groups(wf, group_size), scale, zp, qmin, qmax)
        return wq.reshape(w.shape[0], -1)[:, : w.shape[1]]
    return fake_quantize(wf, scale, zp, qmin, qmax)


# --- int4 ------------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (signed -8..7 or unsigned 0..15) two per byte along the last axis, first in the low nibble."""
    if q.shape[-1] % 2:
        raise FFNQuantError(f"pack_int4 needs an even last dimension, got {q.shape[-1]}")
    nib = (q.to(torch.int32) & 0xF).to(torch.uint8)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """Inverse of pack_int4: int32 codes, sign-extended when `signed`."""
    p = packed.to(torch.int32)
    out = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    if signed:
        out = torch.where(out >= 8, out - 16, out)
    return out


def int4_group_rtn(
    w: torch.Tensor, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MatMulNBits-style group-wise int4 RTN of a [out, in] weight: codes 0..15 [out, K'], scale and zp [out, K'/g, 1].

    K' = ceil(in / g) * g: `in` padded with zero columns to whole groups (K' = in when g divides
    it); the padded codes are the zero point (value 0) and the last group's qparams come from its
    real columns only (see `_pad_columns`). Symmetric: the group's signed extreme m maps to code 0 (value -8): scale = m / -8, zp = 8.
    Asymmetric: [min(lo, 0), max(hi, 0)] over 0..15 with a rounded zero point.
    """
    wg = _groups(w.detach().float(), group_size)
    if symmetric:
        idx = wg.abs().argmax(dim=2, keepdim=True)
        extreme = torch.gather(wg, 2, idx)
        scale = extreme / -8.0
        scale = torch.where(scale != 0, scale, torch.ones_like(scale))
        zp = torch.full_like(scale, 8, dtype=torch.int32)
    else:
        scale, zp = choose_qparams(wg.amin(dim=2, keepdim=True), wg.amax(dim=2, keepdim=True), 0, 15, False)
    q = torch.clamp(torch.round(wg / scale) + zp, 0, 15).to(torch.int32)
    return q.reshape(wg.shape[0], -1), scale, zp


def int4_group_dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, in_features: int | None = None
) -> torch.Tensor:
    """Float weight from int4_group_rtn's codes [out, K'] and [out, K'/g, 1] scale / zero point (int or float).

    `in_features` crops the padded K' columns back to the real input dimension ([out, in_features]);
    None returns all K' columns.
    """
    out_f, in_f = q.shape
    groups = scale.shape[1]
    qg = q.reshape(out_f, groups, in_f // groups).to(torch.float32)
    w = ((qg - zero_point.to(torch.float32)) * scale).reshape(out_f, in_f)
    return w if in_features is None or in_features == in_f else w[:, :in_features]


def hqq_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """HQQ (half-quadratic zero-point fit) int4 fake quantization of a [out, in] weight, groups along `in`.

    Uses onnxruntime's copy of the official HQQ routine, the same one its MatMulNBits
    quantizer runs, so the torch reference and the ONNX artifact use one algorithm. When g does
    not divide `in`, that routine pads `in` with zero columns itself, and the artifact's
    quantizer does the same: unlike the widened-to-0 RTN grids, HQQ's min/max and its fit then
    see the padded zeros in the last group (an all-positive group's range starts at 0). Kept
    as is so that the reference and the artifact stay one algorithm; the result is cropped to `in`.
    """
    q, scale, zero = hqq_int4_codes(w, group_size)
    return int4_group_dequantize(q, scale.unsqueeze(-1), zero.unsqueeze(-1), w.shape[1])


def hqq_int4_codes(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HQQ's codes 0..15 [out, K'], float scales and float zero points [out, K'/g] (`hqq_int4`'s numerics)."""
    mnq = matmul_nbits_quantizer()
    quantizer = mnq.HQQWeightOnlyQuantizer(mnq.HQQWeightOnlyQuantConfig(block_size=group_size, bits=4))
    q, scale, zero = quantizer.quantize_internal(w.detach().float(), bits=4, group_size=group_size)
    return q.reshape(w.shape[0], -1), scale, zero


def gptq_int4(
    w: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool, percdamp: float = 0.01, block: int = 128
) -> torch.Tensor:
    """GPTQ fake quantization of a [out, in] weight (see `gptq_int4_codes`), [out, in]."""
    return int4_group_dequantize(*gptq_int4_codes(w, hessian, group_size, symmetric, percdamp, block), w.shape[1])


def gptq_int4_codes(
    w: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool, percdamp: float = 0.01, block: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ (Frantar et al. 2022) on the int4 group grid of `int4_group_rtn`: codes 0..15 [out, K'], scale and zp [out, K'/g, 1].

    K' = ceil(in / g) * g as in `int4_group_rtn`: GPTQ runs on the real columns only (the Hessian
    is not padded); the last group holds in mod g columns and its qparams come from them; the
    padded codes are that group's zero point (value 0).

    `hessian` is X^T X over calibration inputs ([in, in]). Columns are quantized in order;
    each one's rounding error is spread over the not yet quantized columns through the
    inverse Hessian's Cholesky factor. Group qparams are fixed when a group's first column
    is reached (from the error-updated weights), as in the reference implementation.
    """
    W = w.detach().float().clone()
    out_f, in_f = W.shape
    n_groups = padded_width(in_f, group_size) // group_size
    H = hessian.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    damp = percdamp * torch.mean(torch.diag(H))
    H += damp * torch.eye(in_f, dtype=H.dtype, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    codes = torch.zeros(W.shape, dtype=torch.int32, device=W.device)
    scales = torch.zeros(out_f, n_groups, 1, device=W.device)
    zps = torch.zeros(out_f, n_groups, 1, dtype=torch.int32, device=W.device)
    scale = zp = None
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1 = W[:, i1:i2].clone()
        Err = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                grp = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :group_size]
                _, scale, zp = int4_group_rtn(grp, group_size, symmetric)
                scale, zp = scale[:, 0], zp[:, 0]  # [out, 1]
                scales[:, col // group_size], zps[:, col // group_size] = scale, zp
            wcol = W1[:, i : i + 1]
            q = torch.clamp(torch.round(wcol / scale) + zp, 0, 15)
            qcol = (q - zp) * scale
            codes[:, col : col + 1] = q.to(torch.int32)
            err = (wcol - qcol) / Hinv1[i, i]
            W1[:, i:] -= err @ Hinv1[i : i + 1, i:]
            Err[:, i : i + 1] = err
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    pad = n_groups * group_size - in_f
    if pad:  # the padded columns are zero weights: the last group's zero point
        codes = torch.cat([codes, zps[:, -1].expand(out_f, pad)], dim=1)
    return codes, scales, zps


# --- fp8 -------------------------------------------------------------------------------


def fp8_e4m3_fake(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Round x / scale to float8_e4m3fn (saturating at +-448) and back, times scale."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.clamp(x.float() / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return (y.to(torch.float8_e4m3fn).to(torch.float32) * scale).to(x.dtype)


def fp8_weight_fake(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """fp8 e4m3 fake quantization of a [out, in] weight with a per-tensor or per-channel absmax/448 scale."""
    g = str(getattr(granularity, "value", granularity))
    wf = w.detach().float()
    if g == "per_tensor":
        amax = wf.abs().max()
    elif g == "per_channel":
        amax = wf.abs().amax(dim=1, keepdim=True)
    else:
        raise FFNQuantError(f"fp8 weights take per_tensor or per_channel scales, not {granularity!r}")
    return fp8_e4m3_fake(wf, amax / FP8_E4M3_MAX)


# --- dynamic per-token activations ------------------------------------------------------


def fake_quantize_per_token(x: torch.Tensor, bits: int, signed: bool, symmetric: bool) -> torch.Tensor:
    """Dynamic quantization with one range per token (the last axis is the feature axis)."""
    qmin, qmax = int_range(bits, signed)
    xf = x.float()
    scale, zp = choose_qparams(xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True), qmin, qmax, symmetric)
    return fake_quantize(xf, scale, zp, qmin, qmax).to(x.dtype)


def fp8_per_token_fake(x: torch.Tensor) -> torch.Tensor:
    """Dynamic fp8 e4m3 with one absmax/448 scale per token."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    return fp8_e4m3_fake(x, amax / FP8_E4M3_MAX)


# --- bitsandbytes 4-bit -----------------------------------------------------------------


def bnb_4bit_fake(w: torch.Tensor, quant_type: str, blocksize: int) -> torch.Tensor:
    """NF4 / FP4 round trip through bitsandbytes itself (block-wise absmax over the flattened weight)."""
    quiet_bitsandbytes()  # the Python API imports bitsandbytes here, not through the CLI
    try:
        import bitsandbytes.functional as bnbf
    except Exception as exc:  # bitsandbytes missing or failing to load its native library
        raise FFNQuantError(f"{quant_type} needs bitsandbytes, which is unavailable: {exc}") from exc
    # Flattened here, not by bitsandbytes: its CPU backend (0.50) quantizes a 2-D weight whose
    # row length is not a multiple of `blocksize` wrongly (blocks of [160, 96]: 12.3 dB instead
    # of 20.7 dB, values beyond the block's absmax). Flat, any size works: blocks run over the
    # row-major weight, the last one partial, as MatMulBnb4 stores it. Same numbers when divisible.
    return bnb_4bit_codes(w, quant_type, blocksize)[2]


def bnb_4bit_codes(w: torch.Tensor, quant_type: str, blocksize: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' own NF4 / FP4 of a [out, in] weight: (its packed codes, uint8 [ceil(out * in / 2)], two per byte
    over the flattened row-major weight; its float32 absmax per block; the weight they decode to, [out, in])."""
    quiet_bitsandbytes()
    import bitsandbytes.functional as bnbf

    wf = w.detach().float().contiguous().reshape(-1)
    packed, state = bnbf.quantize_4bit(wf, blocksize=blocksize, quant_type=quant_type)
    deq = bnbf.dequantize_4bit(packed, state).to(torch.float32).reshape(w.shape)
    return packed.reshape(-1), state.absmax.float().reshape(-1), deq


# --- per-row (per-token) and per-tensor quantization in the GPU kernels' conventions ------------------
def int8_symmetric_rows(t):
    """Per-row symmetric int8 (the per-token activations of `w8a8-dynamic-s8` on torch's and ffnquant's
    kernels): q = round(t / s) in [-127, 127], s = absmax(row) / 127 (float32)."""
    scale = t.detach().abs().amax(dim=-1).float().clamp(min=1e-12) / 127.0
    q = torch.round(t.float() / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def fp8_tensorwise(t):
    """Per-tensor scaled fp8 e4m3: q = fp8(t / s), s = absmax / 448 (float32 scalar tensor)."""
    scale = (t.detach().abs().amax().float() / FP8_E4M3_MAX).clamp(min=1e-12)
    q = (t.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_rowwise(t):
    """Per-row scaled fp8 e4m3: q = fp8(t / s[:, None]), s = absmax(row) / 448 (float32 [rows, 1])."""
    scale = (t.detach().abs().amax(dim=-1, keepdim=True).float() / FP8_E4M3_MAX).clamp(min=1e-12)
    q = (t.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale
