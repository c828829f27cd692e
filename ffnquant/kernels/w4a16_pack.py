"""Packed int4 weights for ffnquant's Triton W4A16 kernels, and the torch reference they must match.

`pack_w4` quantizes with the `w4a16-g*` preset's method handler (`int4_group_rtn(w, g, symmetric=True)`: codes 0..15,
zero point 8, one scale per `group_size` input features, stored float16 by default) and packs two codes per
byte (`pack_linear` packs any int4 group QuantizedLinear as it is); with `symmetric=False` it quantizes as the `w4a16-g*-asym` presets do (`int4_group_rtn(w, g,
symmetric=False)`: an integer zero point 0..15 per group, stored as `zero_points`; value (q - zp) * s).
`w4a16_reference` / `w4a16_gated_reference` compute in float32 what the kernels compute up to summation
order. Pure torch: importable and testable without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import FFNQuantError, unknown_choice
from ..model import ACTIVATIONS as FFN_ACTIVATIONS
from ..methods import QuantizedLinear, quantize_linear
from ..numerics.primitives import pack_int4, unpack_int4
from ..schemes import int4_group_scheme
from ..spec import Activation

__all__ = ["ACTIVATIONS", "SCALE_DTYPES", "PackedW4", "check_group", "pack_w4", "pack_linear", "dequantize_w4", "w4a16_reference",
           "w4a16_gated_reference", "torch_act", "describe", "zero_point_values", "KeptDtypes"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "identity")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PackedW4:
    """A [n, k] weight as int4 codes (two per byte, first in the low nibble), per-group scales and, for
    asymmetric groups, per-group zero points (None: symmetric, zero point 8)."""

    packed: torch.Tensor  # uint8 [n, k // 2]
    scales: torch.Tensor  # [n, k // group_size], float16 unless chosen otherwise
    group_size: int
    n: int
    k: int
    zero_points: torch.Tensor | None = None  # uint8 or int8 [n, k // group_size], integers 0..15

    @property
    def symmetric(self) -> bool:
        return self.zero_points is None

    @property
    def nbytes(self) -> int:
        zp = 0 if self.zero_points is None else self.zero_points.numel() * self.zero_points.element_size()
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size() + zp

    def to(self, device) -> PackedW4:
        """The same weight on `device`."""
        zp = None if self.zero_points is None else self.zero_points.to(device)
        return replace(self, packed=self.packed.to(device), scales=self.scales.to(device), zero_points=zp)


def check_group(k: int, group_size: int) -> None:
    """Refuse a group size the kernels cannot take for an input dimension `k`."""
    # 8 | group_size: the gemv kernel reads 8 codes per 32-bit word and never lets a word straddle groups
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        raise FFNQuantError(f"group_size must be a positive multiple of 8, got {group_size!r}")
    if k % group_size:
        raise FFNQuantError(f"group_size {group_size} must divide the input dimension {k}")


def pack_w4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float16,
            symmetric: bool = True) -> PackedW4:
    """Quantize a [n, k] weight with ffnquant's int4 groups (int4_group_rtn) and pack it.

    symmetric=True: zero point 8 (`w4a16-g*`); False: the `w4a16-g*-asym` presets' integer zero points.
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise FFNQuantError(f"pack_w4 needs a 2-D floating [out, in] weight, got {describe(w)}")
    if scale_dtype not in SCALE_DTYPES:
        raise unknown_choice("scale dtype", scale_dtype, SCALE_DTYPES)
    n, k = w.shape
    check_group(k, group_size)
    if not isinstance(symmetric, bool):
        raise FFNQuantError(f"symmetric must be True or False, got {symmetric!r}")
    return pack_linear(quantize_linear(w.detach(), int4_group_scheme(group_size, symmetric)), scale_dtype)


def pack_linear(ql: QuantizedLinear, scale_dtype: torch.dtype = torch.float16) -> PackedW4:
    """Pack the codes and grid of an int4 group QuantizedLinear (its method handler's: RTN, GPTQ, AWQ's share the
    grid) for the kernels: nothing is quantized here."""
    grid = ql.grid
    if grid is None or grid.kind != "int" or grid.bits != 4 or grid.granularity != "per_group":
        raise FFNQuantError(f"pack_linear takes 4-bit group weights, got {ql.scheme.name}")
    if scale_dtype not in SCALE_DTYPES:
        raise unknown_choice("scale dtype", scale_dtype, SCALE_DTYPES)
    n, k = ql.weight.shape
    group_size, symmetric = grid.group_size, grid.symmetric
    check_group(k, group_size)
    q = ql.unsigned_codes()
    scales = grid.scale.to(scale_dtype)
    if not torch.isfinite(scales).all():
        raise FFNQuantError(f"a group scale overflows {scale_dtype}; valid: weights with |w| <= 8 * max({scale_dtype}),"
                            " or scale_dtype=torch.float32")
    zps = None if symmetric else (grid.zero_point + 8).to(torch.uint8).contiguous()
    return PackedW4(pack_int4(q).contiguous(), scales.contiguous(), group_size, n, k, zps)


def zero_point_values(zero_points: torch.Tensor | None, shape: tuple[int, ...], device) -> torch.Tensor:
    """Zero points as float32 (8 everywhere when None, the symmetric groups); exact, they are integers 0..15."""
    if zero_points is None:
        return torch.full(shape, 8.0, device=device)
    return zero_points.to(torch.float32)


def dequantize_w4(p: PackedW4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [n, k] weight the kernel multiplies by: (q - zp) * stored scale (zp = 8 when symmetric) in float32, cast to
    `dtype` (exact for float16 / bfloat16 scales: |q - zp| <= 15 has 4 significant bits)."""
    q = unpack_int4(p.packed, signed=False).reshape(p.n, p.k // p.group_size, p.group_size)
    zp = zero_point_values(p.zero_points, p.scales.shape, p.scales.device)
    w = (q.to(torch.float32) - zp.unsqueeze(-1)) * p.scales.to(torch.float32).unsqueeze(-1)
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
    if act not in ACTIVATIONS:
        raise unknown_choice("activation", act, ACTIVATIONS)
    return FFN_ACTIVATIONS[Activation(act)]


def describe(t) -> str:
    """How an unexpected argument is named in an error: dtype and shape of a tensor, else its type."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


class KeptDtypes(torch.nn.Module):
    """A module whose buffers named in `kept_dtypes` are the numerics of record (codes, scales, zero points):
    `.to(dtype)`, `.half()` move them to the new device but never cast them; a cast of fp16 scales to bf16 would
    change every weight. Everything else follows the call as usual."""

    kept_dtypes: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        saved = {k: self._buffers.pop(k) for k in self.kept_dtypes if k in self._buffers}
        present = [t for t in saved.values() if t is not None]
        try:
            super()._apply(fn, recurse)
            # where fn puts a tensor that is where these were: an empty probe learns the device
            probe = fn(torch.empty(0, device=present[0].device)) if present else None
        finally:
            self._buffers.update(saved)
        for k, t in saved.items():
            self._buffers[k] = None if t is None else t.to(probe.device)
        return self
