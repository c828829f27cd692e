"""Quantization schemes as frozen, validated, versioned data, with presets by name.

A `Scheme` says what happens to the weights (dtype, granularity, symmetry, rounding method)
and to the activations that feed a matmul (`input` and `hidden`: dtype, static or dynamic,
symmetry, calibrator). Presets (`w8a8`, `w4a16-g128`, `nf4`, ...) cover the usual recipes;
`get_scheme(name)` looks one up, `Scheme.from_dict` reads one back from JSON.

This is the one registry of scheme names: the runtimes' formats (`ffnquant.runtimes.FORMATS`)
are views of these presets, and a runtime registers a kernel under a preset's name only when
the kernel computes that preset's numerics. Runtime-only formats (`bf16`, bitsandbytes'
`llm-int8`) are presets too; `Scheme.no_reference_reason` says when ffnquant's own fake
quantization cannot reproduce one.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import FFNQuantError, unknown_choice
from .methods.registry import handler_for, is_method, method_names
from .spec import FFNSpec

__all__ = [
    "SCHEME_VERSION",
    "matrix_bytes",
    "recipe_weight_bytes",
    "weight_bytes",
    "WeightDType",
    "ActDType",
    "Granularity",
    "ActMode",
    "Method",
    "Compute",
    "Scheme",
    "PRESETS",
    "preset_names",
    "register_preset",
    "int4_group_scheme",
    "unregister_preset",
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
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    NF4 = "nf4"  # bitsandbytes NormalFloat4, block-wise absmax
    FP4 = "fp4"  # bitsandbytes FP4 (e2m1), block-wise absmax
    FP8_E4M3 = "fp8_e4m3"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "fp8_e4m3": 8}.get(self.value, 4)

    @property
    def is_float(self) -> bool:
        """True for formats that are not quantized at all (fp32, fp16, bf16)."""
        return self in (WeightDType.FP32, WeightDType.FP16, WeightDType.BF16)


class ActDType(_StrEnum):
    """Format of the activations that feed a matmul; `none` keeps them in fp32."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    UINT8 = "uint8"
    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def is_integer(self) -> bool:
        return self in (ActDType.UINT8, ActDType.INT8)

    @property
    def is_float(self) -> bool:
        """True when the activations are not quantized (kept in fp32, or cast to fp16/bf16)."""
        return self in (ActDType.NONE, ActDType.FP16, ActDType.BF16)


class Granularity(_StrEnum):
    """How many scales a weight matrix gets: one, one per output channel, one per group of inputs."""

    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"
    PER_GROUP = "per_group"


class ActMode(_StrEnum):
    """Static: one calibrated range per site. Dynamic: a range per token, computed at run time."""

    STATIC = "static"
    DYNAMIC = "dynamic"


class Compute(_StrEnum):
    """The arithmetic a scheme's matmuls run in; it picks the device peak in the roofline."""

    FP32 = "fp32"
    FP16 = "fp16"  # fp16 or bf16 tensor-core math (same peak on NVIDIA); also weight-only schemes
    INT8 = "int8"
    FP8 = "fp8"


class Method(_StrEnum):
    """Weight rounding: round-to-nearest, GPTQ (Hessian-aware), HQQ (half-quadratic zero-point fit),
    AWQ (activation-aware per-channel scales folded into the FFN, then round-to-nearest)."""

    RTN = "rtn"
    GPTQ = "gptq"
    HQQ = "hqq"
    AWQ = "awq"


class ExtraMethod(str):
    """The name of a method registered by a handler outside the built-in ones (`ffnquant.methods`)."""

    @property
    def value(self) -> str:
        return str(self)


def _method(value: Any) -> "Method | ExtraMethod":
    """A built-in Method, or the name of a registered method handler; an unknown name lists both."""
    if isinstance(value, Method):
        return value
    key = str(value).strip().lower()
    try:
        return Method(key)
    except ValueError:
        pass

    if is_method(key):
        return ExtraMethod(key)
    raise unknown_choice("method", value, method_names())


def _handler(scheme: "Scheme"):
    """The method handler that quantizes `scheme`'s weights (`methods.handler_for`)."""
    return handler_for(scheme)


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
    (a name from `ffnquant.numerics.calibrate`, used by static integer schemes). `outlier_threshold`
    makes it bitsandbytes' LLM.int8: input columns holding any |x| above it are computed in
    fp16, the rest in per-token int8 (0: the same kernel without the split).
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
    outlier_threshold: float | None = None
    version: int = SCHEME_VERSION

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if not isinstance(self.name, str) or not self.name.strip():
            raise FFNQuantError("scheme name must be a non-empty string")
        wd = _enum(WeightDType, self.weight_dtype, "weight dtype")
        gran = _enum(Granularity, self.weight_granularity, "weight granularity")
        method = _method(self.method)
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
        # the method's own rules (HQQ's fitted zero point, GPTQ's and AWQ's int4 grids...) live in its handler
        why = _handler(self).check(self)
        if why:
            raise FFNQuantError(f"scheme {self.name!r}: {why}")

        # --- activations ------------------------------------------------------------
        mode = self.act_mode
        if ad.is_float:
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
        from .numerics.calibrate import parse_calibrator

        parse_calibrator(self.calibrator)

        # --- LLM.int8's outlier split ------------------------------------------------------
        t = self.outlier_threshold
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise FFNQuantError(f"scheme {self.name!r}: outlier_threshold must be a finite number >= 0, got {t!r}")
            set_("outlier_threshold", float(t))
            # bitsandbytes' Linear8bitLt: row-wise int8 weights, per-token symmetric int8 activations
            if (wd, gran, self.weight_symmetric, method, ad, mode, self.act_symmetric) != (
                    WeightDType.INT8, Granularity.PER_CHANNEL, True, Method.RTN, ActDType.INT8, ActMode.DYNAMIC, True):
                raise FFNQuantError(
                    f"scheme {self.name!r}: outlier_threshold is LLM.int8's column split: it needs int8 per_channel "
                    "symmetric rtn weights and int8 dynamic symmetric activations"
                )

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
    def needs_hessians(self) -> bool:
        """True when the weights are quantized from calibration data: the input Hessians H = sum X^T X (GPTQ, AWQ)."""
        return _handler(self).needs_hessians

    @property
    def weight_bits(self) -> int:
        return self.weight_dtype.bits

    @property
    def compute(self) -> Compute:
        """What the matmuls compute in: the activations' format (weight-only schemes run float math)."""
        ad = self.act_dtype
        if ad.is_integer:
            return Compute.INT8
        if ad is ActDType.FP8_E4M3:
            return Compute.FP8
        if ad is ActDType.NONE and self.weight_dtype is WeightDType.FP32:
            return Compute.FP32
        return Compute.FP16

    @property
    def description(self) -> str:
        """One line saying what the weights and the matmul-input activations become."""
        wd, ad = self.weight_dtype, self.act_dtype
        names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
        if wd.is_float and ad.value == wd.value or (wd is WeightDType.FP32 and ad is ActDType.NONE):
            return f"{names[wd.value]} weights and activations"
        text = f"{self._weight_text()}; {self._act_text()}"
        t = self.outlier_threshold
        if t is None:
            return text
        if t > 0:
            return f"bitsandbytes LLM.int8: {text}; input columns with any |x| > {t:g} computed in fp16"
        # The same row-wise int8 math as w8a8-dynamic-s8; bitsandbytes only quantizes from fp16 inputs.
        return f"bitsandbytes LLM.int8 at threshold 0 (no outlier split): {text}, quantized from fp16 inputs"

    def _weight_text(self) -> str:
        wd, gran = self.weight_dtype, self.weight_granularity
        if wd.is_float:
            return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[wd.value] + " weights"
        if wd in (WeightDType.NF4, WeightDType.FP4):
            kind = "NormalFloat (NF4)" if wd is WeightDType.NF4 else "float e2m1 (FP4)"
            return f"4-bit {kind} weights, absmax per block of {self.group_size}"
        where = {Granularity.PER_TENSOR: "one scale per tensor", Granularity.PER_CHANNEL: "a scale per output channel",
                 Granularity.PER_GROUP: f"a scale per {self.group_size} input features"}[gran]
        if wd is WeightDType.FP8_E4M3:
            return f"fp8 e4m3 weights, {where}"
        if self.method is Method.HQQ:
            sym = "asymmetric"  # HQQ's zero points are fitted floats, not integers
        elif self.weight_symmetric:
            sym = "symmetric (group extreme on code -8)" if wd is WeightDType.INT4 and gran is Granularity.PER_GROUP \
                else "symmetric"
        else:
            sym = "asymmetric (integer zero point)"
        method = _handler(self).describe or str(self.method)
        return f"{wd.value} weights, {sym}, {where}, {method}"

    def _act_text(self) -> str:
        ad = self.act_dtype
        if ad is ActDType.NONE:
            return "float activations (weight-only)"
        if ad.is_float:
            return {"fp16": "float16", "bf16": "bfloat16"}[ad.value] + " activations"
        kind = "fp8 e4m3" if ad is ActDType.FP8_E4M3 else f"{ad.value} {'symmetric' if self.act_symmetric else 'asymmetric'}"
        if self.act_mode is ActMode.DYNAMIC:
            return f"{kind} activations, a range per token computed per call"
        return f"{kind} activations, one static range per site ({self.calibrator} calibration)"

    @property
    def no_reference_reason(self) -> str | None:
        """Why ffnquant's fake quantization (`ffnquant.methods.fakequant`) cannot reproduce this scheme; None when it can."""
        if self.outlier_threshold:
            return (f"scheme {self.name!r}: bitsandbytes' LLM.int8 outlier split (columns beyond |{self.outlier_threshold:g}| "
                    "in fp16) is a runtime kernel; ffnquant has no fake quantization of it")
        if WeightDType.BF16 in (self.weight_dtype, self.act_dtype):
            return f"scheme {self.name!r}: bf16 is a runtime format; ffnquant's fake quantization has no bf16 rounding"
        return None

    def with_(self, **changes: Any) -> "Scheme":
        """A validated copy with some fields changed (e.g. another calibrator)."""
        return dataclasses.replace(self, **changes)

    # --- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, (enum.Enum, ExtraMethod)):
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
        S("bf16", W.BF16, G.PER_TENSOR, act_dtype=A.BF16),
        S("w8a16", W.INT8, G.PER_CHANNEL),
        # uint8 asymmetric activations: the fast path of onnxruntime's CPU provider (U8S8)
        S("w8a8", W.INT8, G.PER_CHANNEL, act_dtype=A.UINT8, act_mode=ActMode.STATIC),
        S("w8a8-s8", W.INT8, G.PER_CHANNEL, act_dtype=A.INT8, act_mode=ActMode.STATIC, act_symmetric=True),
        S("w8a8-dynamic", W.INT8, G.PER_CHANNEL, act_dtype=A.UINT8, act_mode=ActMode.DYNAMIC),
        # int8 symmetric per token: what GPU int8 GEMMs take (torch._int_mm, cuBLAS), no zero point
        S("w8a8-dynamic-s8", W.INT8, G.PER_CHANNEL, act_dtype=A.INT8, act_mode=ActMode.DYNAMIC, act_symmetric=True),
    ]
    for g in (32, 64, 128):
        out.append(S(f"w4a16-g{g}", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=True))
        out.append(S(f"w4a16-g{g}-asym", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=False))
        out.append(S(f"w4a16-g{g}-hqq", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=False, method=M.HQQ))
        out.append(S(f"w4a16-g{g}-gptq", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=True, method=M.GPTQ))
        # zero points, as AutoAWQ's default (zero_point=True)
        out.append(S(f"w4a16-g{g}-awq", W.INT4, G.PER_GROUP, group_size=g, weight_symmetric=False, method=M.AWQ))
    out += [
        # bitsandbytes' default block size is 64
        S("nf4", W.NF4, G.PER_GROUP, group_size=64),
        S("fp4", W.FP4, G.PER_GROUP, group_size=64),
        S("fp8-e4m3", W.FP8_E4M3, G.PER_TENSOR, act_dtype=A.FP8_E4M3, act_mode=ActMode.STATIC),
        S("fp8-e4m3-pc", W.FP8_E4M3, G.PER_CHANNEL, act_dtype=A.FP8_E4M3, act_mode=ActMode.STATIC),
        S("fp8-e4m3-dynamic", W.FP8_E4M3, G.PER_CHANNEL, act_dtype=A.FP8_E4M3, act_mode=ActMode.DYNAMIC),
        # bitsandbytes' Linear8bitLt; 6.0 separates the emergent outlier features (Dettmers et al. 2022)
        S("llm-int8", W.INT8, G.PER_CHANNEL, act_dtype=A.INT8, act_mode=ActMode.DYNAMIC, outlier_threshold=6.0),
        S("llm-int8-t0", W.INT8, G.PER_CHANNEL, act_dtype=A.INT8, act_mode=ActMode.DYNAMIC, outlier_threshold=0.0),
    ]
    return {s.name: s for s in out}


PRESETS: Mapping[str, Scheme] = _presets()
_BUILTIN_PRESETS = frozenset(PRESETS)


def preset_names() -> list[str]:
    return list(PRESETS)


def int4_group_scheme(group_size: int, symmetric: bool = True) -> Scheme:
    """The `w4a16-g{group_size}[-asym]` scheme: the preset where one exists, else the same numerics for that group
    (the Triton packer and torch's int4 kernel take any group that divides the width)."""
    name = f"w4a16-g{group_size}" + ("" if symmetric else "-asym")
    if name in PRESETS:
        return PRESETS[name]
    return Scheme(name, WeightDType.INT4, Granularity.PER_GROUP, group_size=group_size, weight_symmetric=symmetric)


def register_preset(scheme: Scheme) -> Scheme:
    """Add `scheme` to the presets under its name (a new method's preset, `ffnquant.methods`); a name already
    taken is an error naming it."""
    if not isinstance(scheme, Scheme):
        raise FFNQuantError(f"register_preset takes a Scheme, got {type(scheme).__name__}")
    key = scheme.name.strip().lower()
    if key in PRESETS:
        raise FFNQuantError(f"scheme preset {key!r} exists already; choose another name")
    PRESETS[key] = scheme  # type: ignore[index]  (the registry is a dict behind its Mapping type)
    return scheme


def unregister_preset(name: str) -> None:
    """Remove a preset added by `register_preset` (the built-in ones stay)."""
    key = str(name).strip().lower()
    if key in _BUILTIN_PRESETS:
        raise FFNQuantError(f"scheme preset {key!r} is built in and cannot be removed")
    PRESETS.pop(key, None)  # type: ignore[attr-defined]


def get_scheme(name: str | Scheme) -> Scheme:
    """A preset by name (or the scheme itself); an unknown name lists the presets."""
    if isinstance(name, Scheme):
        return name
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise unknown_choice("scheme", name, PRESETS)
    return PRESETS[key]


def check_scheme_fits(scheme: Scheme, spec: FFNSpec) -> None:
    """Raise FFNQuantError when ffnquant cannot quantize the FFN with the scheme: a scheme only runtimes
    implement (`Scheme.no_reference_reason`) or a width the groups cannot cover.

    Any group size fits any width: a group that does not divide a matrix's input dimension K
    (d_model for w_up/w_gate, d_ff for w_down) pads K with zero columns to ceil(K / g) groups,
    the last holding K mod g real columns, as MatMulNBits stores it; a group larger than K is one
    padded group. Runtimes whose kernels need divisibility refuse it in their own `check`."""
    if scheme.no_reference_reason is not None:
        raise FFNQuantError(scheme.no_reference_reason)
    if scheme.weight_granularity is not Granularity.PER_GROUP:
        return
    g = scheme.group_size
    for dim_name, dim in (("d_model", spec.d_model), ("d_ff", spec.d_ff)):
        if not isinstance(dim, int) or dim < 1:
            raise FFNQuantError(f"scheme {scheme.name!r}: {dim_name}={dim!r} of {spec.key} has no groups of {g}")


# --- storage sizes ----------------------------------------------------------------------
def recipe_weight_bytes(spec: FFNSpec, recipe: Any) -> int:
    """`weight_bytes` of a recipe: a `+float=SITE` recipe stores that site's matrices in 16 bits (how a float
    fallback is deployed) and the others in the scheme's format."""
    quantized, _ = recipe.quantized_parts(spec)
    scheme = recipe.resolve()
    return 4 * spec.n_bias_params + sum(
        matrix_bytes(n_out, n_in, scheme) if name in quantized or not scheme.quantizes_weights else 2 * n_out * n_in
        for name, (n_out, n_in) in spec.weight_shapes.items())


def weight_bytes(spec: FFNSpec, scheme: Any) -> int:
    """Stored bytes of the weight matrices in the scheme's format, with their scales (and zero points),
    plus fp32 biases: the size the deployed weights carry (artifact files add graph overhead)."""
    return 4 * spec.n_bias_params + sum(matrix_bytes(n_out, n_in, scheme) for n_out, n_in in spec.weight_shapes.values())


def matrix_bytes(n_out: int, n_in: int, scheme: Any) -> int:
    """Stored bytes of one [n_out, n_in] weight matrix in the scheme's format, with its scales (and zero points).

    Group scales count 4 bytes: the MatMulNBits artifacts store float32 scales and bitsandbytes keeps
    float32 absmax per block; 4-bit zero points pack two per byte along each row's blocks.

    A group that does not divide the input width K is stored padded, as the artifact holds it: int4
    groups pad each row to ceil(K / g) * g codes (one scale, one zero point per padded group);
    bitsandbytes' blocks run over the flattened matrix, so nf4/fp4 pay only a last partial block
    (ceil(out * K / g) absmax values, ceil(out * K / 2) code bytes)."""
    wd = scheme.weight_dtype
    n = n_out * n_in
    if wd.is_float:
        return n * wd.bits // 8
    gran = scheme.weight_granularity.value
    if gran == "per_group":
        g = scheme.group_size
        if wd.value in ("nf4", "fp4"):
            return math.ceil(n * wd.bits / 8) + 4 * math.ceil(n / g)
        blocks = math.ceil(n_in / g)
        zp_bytes = 0 if scheme.weight_symmetric else n_out * math.ceil(blocks / 2)
        return n_out * math.ceil(blocks * g * wd.bits / 8) + 4 * n_out * blocks + zp_bytes
    if gran == "per_channel":
        return math.ceil(n * wd.bits / 8) + 4 * n_out + (0 if scheme.weight_symmetric else n_out)
    return math.ceil(n * wd.bits / 8) + 4
