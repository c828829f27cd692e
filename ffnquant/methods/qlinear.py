"""`QuantizedLinear`: one quantized weight matrix, as every consumer reads it.

A method handler (`ffnquant.methods`) makes it once per weight; the fake-quant forward takes its `weight`, the
ONNX writers (`onnx.onnxmatmul`), the deployment formats (`QuantizedFFN.weight_grids`, `ModuleQuant.codes`) and the
runtime kernels its `codes` and grid, so nothing downstream quantizes a weight again or finds it by value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import FFNQuantError

if TYPE_CHECKING:  # annotations only
    from .fakequant import SiteRange

__all__ = ["WeightGrid", "QuantizedLinear", "signed_zero_point"]


@dataclass(frozen=True)
class WeightGrid:
    """The grid a quantized weight lies on, so that a deployment format can store its codes exactly.

    Integer grids are given on the signed range of `bits` (qmin = -2^(bits-1)): value = (code - zero_point)
    * scale, with `zero_point` 0 everywhere when `symmetric`. ffnquant's unsigned grids (asymmetric 0..255,
    MatMulNBits' 0..15) are shifted by 2^(bits-1) in codes and zero points alike, which changes no value.
    fp8 grids (`kind` "fp8"): value = fp8_e4m3(w / scale) * scale. `scale` is [] (per tensor), [out, 1] (per
    channel) or [out, groups] (per group of `group_size` inputs; a last group padded with zero columns when
    the group does not divide the input width).
    """

    kind: str  # "int" or "fp8"
    bits: int
    granularity: str
    symmetric: bool
    scale: torch.Tensor
    zero_point: torch.Tensor | None  # int32, the scale's shape; None for fp8
    group_size: int | None = None

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1


def signed_zero_point(zero_point: torch.Tensor, bits: int, was_unsigned: bool) -> torch.Tensor:
    """A zero point on the signed range of `bits` (an unsigned grid's shifted by 2^(bits-1)), int32."""
    return (zero_point - (1 << (bits - 1)) if was_unsigned else zero_point).to(torch.int32)


@dataclass(frozen=True, eq=False)
class QuantizedLinear:
    """One weight matrix quantized under `scheme` by its method's handler.

    - `weight`: [out, in], the values the stored form decodes to (what the fake-quant forward multiplies by):
      float32, or the dtype the FFN computes in (`deploy.precision.in_dtype`: bf16 values, exactly).
    - `grid` and `codes`: the integer grid and the codes on its signed range, [out, in] ([out, K'] for groups, the
      padded columns holding the zero point), int8 (a grid of 8 bits or fewer: a quarter of int32's bytes, which
      for a model's every weight is most of what an export holds beside its float copies; arithmetic on them
      widens first, as `unsigned_codes` does), or the fp8 grid and its float8_e4m3fn codes; None for float
      weights and code-book formats.
    - `zero_float`: HQQ's fitted float zero points [out, groups] with unsigned 0..15 `codes` and no integer grid
      (value = (code - zero_float) * scale, `grid` None, the scales in `scale_float`).
    - bitsandbytes' nf4 / fp4: `codes` its packed uint8 codes over the flattened weight, `scale_float` its block
      absmax, `grid` None (a code book, not an integer grid).
    - `name`, `input_site`, `input_mode` ('static', 'dynamic' or None) and `input_range` (the static SiteRange):
      the input quantizer of the matmul, set once the FFN's activation ranges are calibrated (`with_input`).
    """

    weight: torch.Tensor
    scheme: Any
    grid: WeightGrid | None = None
    codes: torch.Tensor | None = None
    zero_float: torch.Tensor | None = None
    scale_float: torch.Tensor | None = None
    name: str = ""
    input_site: str | None = None
    input_mode: str | None = None
    input_range: "SiteRange | None" = None

    def __post_init__(self) -> None:
        grid, codes = self.grid, self.codes
        if grid is not None and grid.kind == "int" and grid.bits <= 8 and codes is not None \
                and codes.dtype != torch.int8 and not codes.is_floating_point():
            object.__setattr__(self, "codes", codes.to(torch.int8))  # exact: the signed range fits

    @property
    def method(self) -> str:
        return str(self.scheme.method)

    def with_input(self, name: str, site: str, mode: str | None, rng: "SiteRange | None") -> "QuantizedLinear":
        """The same weight named `name`, with the quantizer of the activation its matmul reads."""
        import dataclasses

        return dataclasses.replace(self, name=name, input_site=site, input_mode=mode, input_range=rng)

    def unsigned_codes(self) -> torch.Tensor:
        """The codes on the unsigned range (0..2^bits - 1) with their zero points shifted alike: what onnxruntime's
        asymmetric int8 (uint8) and MatMulNBits (0..15) store."""
        if self.codes is None or self.grid is None:
            raise FFNQuantError(f"{self.name or 'weight'}: {self.scheme.name} stores no integer codes (a float weight or a "
                                "code book)")
        return self.codes.to(torch.int32) + (1 << (self.grid.bits - 1))
