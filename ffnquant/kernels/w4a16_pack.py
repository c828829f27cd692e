"""Packed int4 weights for ffnquant's Triton W4A16 kernels, and the torch reference they must match.

`pack_w4` quantizes with `ffnquant.primitives.int4_group_rtn(w, g, symmetric=True)` (codes 0..15, zero
point 8, one scale per `group_size` input features, stored float16 by default) and packs two codes per
byte; `w4a16_reference` / `w4a16_gated_reference` compute in float32 what the kernels compute up to
summation order. Pure torch: importable and testable without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import FFNQuantError, unknown_choice
from ..primitives import int4_group_rtn, pack_int4, unpack_int4

__all__ = ["ACTIVATIONS", "SCALE_DTYPES", "PackedW4", "check_group", "pack_w4", "dequantize_w4", "w4a16_reference",
           "w4a16_gated_reference", "torch_act", "describe"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "identity")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PackedW4:
    """A [n, k] weight as int4 codes (two per byte, first in the low nibble) and per-group scales."""

    packed: torch.Tensor  # uint8 [n, k // 2]
    scales: torch.Tensor  # [n, k // group_size], float16 unless chosen otherwise
    group_size: int
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()

    def to(self, device) -> PackedW4:
        """The same weight on `device`."""
        return replace(self, packed=self.packed.to(device), scales=self.scales.to(device))


def check_group(k: int, group_size: int) -> None:
    """Refuse a group size the kernels cannot take for an input dimension `k`."""
    # 8 | group_size: the gemv kernel reads 8 codes per 32-bit word and never lets a word straddle groups
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        raise FFNQuantError(f"group_size must be a positive multiple of 8, got {group_size!r}")
    if k % group_size:
        raise FFNQuantError(f"group_size {group_size} must divide the input dimension {k}")


def pack_w4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float16) -> PackedW4:
    """Quantize a [n, k] weight with ffnquant's symmetric int4 groups (int4_group_rtn) and pack it."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise FFNQuantError(f"pack_w4 needs a 2-D floating [out, in] weight, got {describe(w)}")
    if scale_dtype not in SCALE_DTYPES:
        raise unknown_choice("scale dtype", scale_dtype, SCALE_DTYPES)
    n, k = w.shape
    check_group(k, group_size)
    q, scale, _zp = int4_group_rtn(w.detach(), group_size, symmetric=True)
    scales = scale.squeeze(-1).to(scale_dtype)
    if not torch.isfinite(scales).all():
        raise FFNQuantError(f"a group scale overflows {scale_dtype}; valid: weights with |w| <= 8 * max({scale_dtype}),"
                            " or scale_dtype=torch.float32")
    return PackedW4(pack_int4(q).contiguous(), scales.contiguous(), group_size, n, k)


def dequantize_w4(p: PackedW4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [n, k] weight the kernel multiplies by: (q - 8) * stored scale, computed in float32 (exact), cast to `dtype`."""
    q = unpack_int4(p.packed, signed=False).reshape(p.n, p.k // p.group_size, p.group_size)
    w = (q.to(torch.float32) - 8.0) * p.scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(p.n, p.k).to(dtype)


def w4a16_reference(x: torch.Tensor, p: PackedW4) -> torch.Tensor:
    """x @ dequantize_w4(p).T in float32, cast to x.dtype: what w4a16_matmul computes up to summation order."""
    return (x.to(torch.float32) @ dequantize_w4(p).to(x.device).T).to(x.dtype)


def w4a16_gated_reference(x: torch.Tensor, p_gate: PackedW4, p_up: PackedW4, act: str) -> torch.Tensor:
    """act(x @ Wg^T) * (x @ Wu^T) in float32 with torch's activations, cast to x.dtype."""
    xf = x.to(torch.float32)
    g = xf @ dequantize_w4(p_gate).to(x.device).T
    u = xf @ dequantize_w4(p_up).to(x.device).T
    return (torch_act(act)(g) * u).to(x.dtype)


def torch_act(act: str):
    """The FFN's own activation called `act` (ffnquant.model.ACTIVATIONS): what the kernel must match."""
    from ..model import ACTIVATIONS as FFN_ACTIVATIONS
    from ..spec import Activation

    if act not in ACTIVATIONS:
        raise unknown_choice("activation", act, ACTIVATIONS)
    return FFN_ACTIVATIONS[Activation(act)]


def describe(t) -> str:
    """How an unexpected argument is named in an error: dtype and shape of a tensor, else its type."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__
