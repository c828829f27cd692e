"""Quantization schemes as frozen, validated, versioned data, with presets by name.

A `Scheme` says what happens to the weights (dtype, granularity, symmetry, rounding method)
and to the activations that feed a matmul (`input` and `hidden`: dtype, static or dynamic,
symmetry, calibrator). Presets (`w8a8`, `w4a16-g128`, `nf4`, ...) cover the usual recipes;
`get_scheme(name)` looks one up, `Scheme.from_dict` reads one back from JSON.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import FFNQuantError, unknown_choice
from .spec import FFNSpec

__all__ = [
    "SCHEME_VERSION",
    "WeightDType",
    "ActDType",
    "Granularity",
    "ActMode",
    "Method",
    "Scheme",
    "PRESETS",
    "preset_names",
    "get_scheme",
    "check_scheme_fits",
]

SCHEME_VERSION = 1


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:  # print the key, not the enum repr
        return self.value


class WeightDType(_StrEnum):
    """Storage format of the weights."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"
    NF4 = "nf4"  # bitsandbytes NormalFloat4, block-wise absmax
    FP4 = "fp4"  # bitsandbytes FP4 (e2m1), block-wise absmax
    FP8_E4M3 = "fp8_e4m3"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "int8": 8, "fp8_e4m3": 8}.get(self.value, 4)

    @property
    def is_float(self) -> bool:
        """True for formats that are not quantized at all (fp32, fp16)."""
        return self in (WeightDType.FP32, WeightDType.FP16)


class ActDType(_StrEnum):
    """Format of the activations that feed a matmul; `none` keeps them in fp32."""

    NONE = "none"
    FP16 = "fp16"
    UINT8 = "uint8"
    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def is_integer(self) -> bool:
        return self in (ActDType.UINT8, ActDType.INT8)


class Granularity(_StrEnum):
    """How many scales a weight matrix gets: one, one per output channel, one per group of inputs."""

    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"
    PER_GROUP = "per_group"


class ActMode(_StrEnum):
    """Static: one calibrated range per site. Dynamic: a range per token, computed at run time."""

    STATIC = "static"
    DYNAMIC = "dynamic"


class Method(_StrEnum):
    """Weight rounding: round-to-nearest, GPTQ (Hessian-aware), HQQ (half-quadratic zero-point fit)."""

    RTN = "rtn"
    GPTQ = "gptq"
    HQQ = "hqq"


def _enum(cls: type[enum.Enum], value: Any, kind: str):
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).strip().lower())
    except ValueError:
        raise unknown_choice(kind, value, list(cls)) from None


@dataclass(frozen=True)
class Scheme:
    """One quantization recipe. Frozen and validated on construction; JSON round trip via to_dict/from_dict.

    Weights: `weight_dtype` with `weight_granularity` (per_group uses `group_size` consecutive
    input features per scale, the MatMulNBits/GPTQ convention), `weight_symmetric`, `method`.
    Activations at the matmul inputs (`input`, `hidden`): `act_dtype` (`none` = float),
    `act_mode` static (a calibrated per-tensor range per site) or dynamic (per token),
    `act_symmetric` (uint8 is asymmetric by default, int8 symmetric) and `calibrator`
    (a name from `ffnquant.calibrate`, used by static integer schemes).
    """

    name: str
    weight_dtype: WeightDType = WeightDType.INT8
    weight_granularity: Granularity = Granularity.PER_CHANNEL
    group_size: int | None = None
    weight_symmetric: bool = True
    method: Method = Method.RTN
    act_dtype: ActDType = ActDType.NONE
    act_mode: ActMode | None = None
    act_symmetric: bool | None = None
    calibrator: str = "minmax"
    version: int = SCHEME_VERSION

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if not isinstance(self.name, str) or not self.name.strip():
            raise FFNQuantError("scheme name must be a non-empty string")
        wd = _enum(WeightDType, self.weight_dtype, "weight dtype")
        gran = _enum(Granularity, self.weight_granularity, "weight granularity")
        method = _enum(Method, self.method, "method")
        ad = _enum(ActDType, self.act_dtype, "activation dtype")
        set_("weight_dtype", wd)
        set_("weight_granularity", gran)
        set_("method", method)
        set_("act_dtype", ad)
        if self.version != SCHEME_VERSION:
            raise FFNQuantError(f"scheme {self.name!r}: version {self.version!r} is not supported (expected {SCHEME_VERSION})")
        if not isinstance(self.weight_symmetric, bool):
            raise FFNQuantError(f"scheme {self.name!r}: weight_symmetric must be true or false")

        # --- weights ---------------------------------------------------------------
        if gran is Granularity.PER_GROUP:
            g = self.group_size
            if isinstance(g, bool) or not isinstance(g, int) or g < 2:
                raise FFNQuantError(f"scheme {self.name!r}: per_group needs an integer group_size >= 2, got {g!r}")
        elif self.group_size is not None:
            raise FFNQuantError(f"scheme {self.name!r}: group_size is only meaningful with per_group granularity")
        if wd.is_float:
            if method is not Method.RTN:
                raise FFNQuantError(f"scheme {self.name!r}: {wd} weights are not quantized; method must be rtn")
        if wd in (WeightDType.NF4, WeightDType.FP4):
            # bitsandbytes' 4-bit formats are block-wise absmax over fixed code books
            if gran is not Granularity.PER_GROUP or not self.weight_symmetric or method is not Method.RTN:
                raise FFNQuantError(
                    f"scheme {self.name!r}: {wd} is bitsandbytes' block-wise absmax format: "
                    "use per_group granularity, symmetric, method rtn"
                )
        if wd is WeightDType.FP8_E4M3:
            if gran is Granularity.PER_GROUP or not self.weight_symmetric or method is not Method.RTN:
                raise FFNQuantError(f"scheme {self.name!r}: fp8_e4m3 weights take per_tensor or per_channel scales, symmetric, rtn")
        if method is Method.HQQ and (wd is not WeightDType.INT4 or self.weight_symmetric):
            raise FFNQuantError(f"scheme {self.name!r}: hqq fits a zero point: int4 weights, asymmetric")
        if method is Method.GPTQ and wd not in (WeightDType.INT4, WeightDType.INT8):
            raise FFNQuantError(f"scheme {self.name!r}: gptq applies to int4/int8 weights")

        # --- activations ------------------------------------------------------------
        mode = self.act_mode
        if ad in (ActDType.NONE, ActDType.FP16):
            if mode is not None:
                raise FFNQuantError(f"scheme {self.name!r}: activation mode needs quantized activations (act_dtype is {ad})")
            if self.act_symmetric is not None:
                raise FFNQuantError(f"scheme {self.name!r}: act_symmetric needs quantized activations (act_dtype is {ad})")
        else:
            mode = _enum(ActMode, mode if mode is not None else ActMode.STATIC, "activation mode")
            set_("act_mode", mode)
            sym = self.act_symmetric
            if sym is None:
                sym = ad is not ActDType.UINT8  # uint8 activations are asymmetric, int8 and fp8 symmetric
                set_("act_symmetric", sym)
            if not isinstance(sym, bool):
                raise FFNQuantError(f"scheme {self.name!r}: act_symmetric must be true or false")
            if ad is ActDType.FP8_E4M3 and not sym:
                raise FFNQuantError(f"scheme {self.name!r}: fp8_e4m3 activations are symmetric (scale only)")
        if not isinstance(self.calibrator, str) or not self.calibrator.strip():
            raise FFNQuantError(f"scheme {self.name!r}: calibrator must be a name")
        # checked against the registry lazily (calibrate imports nothing from here)
        from .calibrate import parse_calibrator

        parse_calibrator(self.calibrator)

    # --- derived facts -------------------------------------------------------------
    @property
    def quantizes_weights(self) -> bool:
        return self.weight_dtype is not WeightDType.FP32

    @property
    def quantizes_activations(self) -> bool:
        return self.act_dtype is not ActDType.NONE

    @property
    def static_activations(self) -> bool:
        """True when the scheme needs calibrated ranges (static integer or fp8 activations)."""
        return self.act_mode is ActMode.STATIC

    @property
    def weight_bits(self) -> int:
        return self.weight_dtype.bits

    def with_(self, **changes: Any) -> "Scheme":
        """A validated copy with some fields changed (e.g. another calibrator)."""
        return dataclasses.replace(self, **changes)

    # --- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, enum.Enum):
                d[k] = v.value
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Scheme":
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise FFNQuantError(f"unknown Scheme field(s) {extra}; valid: {sorted(known)}")
        return cls(**dict(data))


def _presets() -> dict[str, Scheme]:
    S, W, A, G, M = Scheme, WeightDType, ActDType, Granularity, Method
    out = [
        S("fp32", W.FP32, G.PER_TENSOR),
        S("fp16", W.FP16, G.PER_TENSOR, act_dtype=A.FP16),
        S("w8a16", W.INT8, G.PER_CHANNEL),
        # uint8 asymmetric activations: the fast path of onnxruntime's CPU provider (U8S8)
        S("w8a8", W.INT8, G.PER_CHANNEL, act_dtype=A.UINT8, act_mode=ActMode.STATIC),
        S("w8a8-s8", W.INT8, G.PER_CHANNEL, act_dtype=A.INT8, act_mode=ActMode.STATIC, act_symmetric=True),
        S("w8a8-dynamic", W.INT8, G.PER_CHANNEL, act_dtype=A.UINT8, act_mode=ActMode.DYNAMIC),
    ]
    for g in (32, 64, 128):
        out.append(S(f"w4a16-g{g}", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=True))
        out.append(S(f"w4a16-g{g}-asym", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=False))
        out.append(S(f"w4a16-g{g}-hqq", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=False, method=M.HQQ))
        out.append(S(f"w4a16-g{g}-gptq", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=True, method=M.GPTQ))
    out += [
        # bitsandbytes' default block size is 64
        S("nf4", W.NF4, G.PER_GROUP, group_size=64),
        S("fp4", W.FP4, G.PER_GROUP, group_size=64),
        S("fp8-e4m3", W.FP8_E4M3, G.PER_TENSOR, act_dtype=A.FP8_E4M3, act_mode=ActMode.STATIC),
        S("fp8-e4m3-pc", W.FP8_E4M3, G.PER_CHANNEL, act_dtype=A.FP8_E4M3, act_mode=ActMode.STATIC),
        S("fp8-e4m3-dynamic", W.FP8_E4M3, G.PER_CHANNEL, act_dtype=A.FP8_E4M3, act_mode=ActMode.DYNAMIC),
    ]
    return {s.name: s for s in out}


PRESETS: Mapping[str, Scheme] = _presets()


def preset_names() -> list[str]:
    return list(PRESETS)


def get_scheme(name: str | Scheme) -> Scheme:
    """A preset by name (or the scheme itself); an unknown name lists the presets."""
    if isinstance(name, Scheme):
        return name
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise unknown_choice("scheme", name, PRESETS)
    return PRESETS[key]


def check_scheme_fits(scheme: Scheme, spec: FFNSpec) -> None:
    """Raise FFNQuantError when the scheme cannot apply to the FFN (group size vs d_model / d_ff)."""
    if scheme.weight_granularity is not Granularity.PER_GROUP:
        return
    g = scheme.group_size
    # groups run along each matmul's input dimension: d_model for w_up/w_gate, d_ff for w_down
    for dim_name, dim in (("d_model", spec.d_model), ("d_ff", spec.d_ff)):
        if dim % g:
            raise FFNQuantError(
                f"scheme {scheme.name!r}: group size {g} does not divide {dim_name}={dim} of {spec.key}"
            )
