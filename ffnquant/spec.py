"""The FFN family as data: variants, the frozen FFNSpec, the width rule, parameter and FLOP counts."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import FFNQuantError, unknown_choice
from .infra.resources import MAX_ELEMENTS

__all__ = [
    "Variant",
    "Activation",
    "FFNSpec",
    "VARIANT_ACTIVATION",
    "SITES",
    "GATED_ONLY_SITES",
    "WEIGHTS",
    "parse_variant",
    "parse_variants",
    "gated_width",
]


class Variant(str, enum.Enum):
    """FFN variants: two dense-activation families and the GLU family (Shazeer 2020)."""

    RELU = "relu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    SWISH = "swish"
    GLU = "glu"
    BILINEAR = "bilinear"
    REGLU = "reglu"
    GEGLU = "geglu"
    SWIGLU = "swiglu"

    @property
    def gated(self) -> bool:
        return self in _GATED

    def __str__(self) -> str:  # so f-strings and argparse print the key, not the enum repr
        return self.value


class Activation(str, enum.Enum):
    """Elementwise nonlinearities (the gate's, for gated variants)."""

    RELU = "relu"
    GELU = "gelu"  # erf form
    GELU_TANH = "gelu_tanh"
    SILU = "silu"
    SIGMOID = "sigmoid"
    IDENTITY = "identity"
    RELU2 = "relu2"  # relu(x)^2 (Primer; Nemotron, Arcee): never a variant's own, an override of RELU or REGLU
    # the model's own elementwise activation module, with its learned parameters per layer (Apertus' xIELU): found
    # by `hf.discover`, read from each layer's checkpoint; only an FFN loaded from a model computes it
    OWN = "own"
    # the model's own function of gate and up together, hidden = fn(gate, up): an experts module's gate function
    # (MiniMax-M3's clamped, Inkling 2's soft-capped SwiGLU, gpt-oss'), or all a dense MLP computes between its
    # Linears (BitNet's, Dory's norms); the act site is its output; gated FFNs loaded from a model only
    OWN_GATE = "own_gate"

    def __str__(self) -> str:
        return self.value


_GATED = frozenset({Variant.GLU, Variant.BILINEAR, Variant.REGLU, Variant.GEGLU, Variant.SWIGLU})
# Biases by default where the reference models had them (2017 ReLU FFN, BERT, GPT-2);
# Swish and the GLU family follow PaLM/Llama and drop them.
_BIAS_BY_DEFAULT = frozenset({Variant.RELU, Variant.GELU, Variant.GELU_TANH})

VARIANT_ACTIVATION: Mapping[Variant, Activation] = {
    Variant.RELU: Activation.RELU,
    Variant.GELU: Activation.GELU,
    Variant.GELU_TANH: Activation.GELU_TANH,
    Variant.SWISH: Activation.SILU,
    Variant.GLU: Activation.SIGMOID,
    Variant.BILINEAR: Activation.IDENTITY,
    Variant.REGLU: Activation.RELU,
    Variant.GEGLU: Activation.GELU,
    Variant.SWIGLU: Activation.SILU,
}

# Tensor sites, named the same in every variant (the README's FFN family table).
SITES = ("input", "gate_pre", "up", "act", "hidden", "output")
GATED_ONLY_SITES = frozenset({"gate_pre"})
WEIGHTS = ("w_up", "w_gate", "w_down")

# Ops per element charged for each nonlinearity in the nominal FLOP count; a
# convention (transcendentals counted as one op), stated in `flops_per_token`.
_ACT_OPS = {
    Activation.RELU: 1,
    Activation.GELU: 1,
    Activation.GELU_TANH: 1,
    Activation.SILU: 1,
    Activation.SIGMOID: 1,
    Activation.IDENTITY: 0,
    Activation.RELU2: 2,
    Activation.OWN: 1,  # unknown: charged as one op, like a transcendental
    Activation.OWN_GATE: 1,
}


def parse_variant(name: str | Variant) -> Variant:
    """Variant from its key; an unknown key raises an error listing the valid ones."""
    if isinstance(name, Variant):
        return name
    try:
        return Variant(str(name).strip().lower())
    except ValueError:
        raise unknown_choice("variant", name, list(Variant)) from None


def parse_variants(names: str | list[str] | None) -> list[Variant]:
    """Comma-separated or listed variant keys; None or 'all' means every variant.

    An empty string or list is refused rather than read as 'all': it is usually an unset variable.
    """
    if names is None:
        return list(Variant)
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    if not names:
        raise FFNQuantError("no variant given; valid: all, " + ", ".join(v.value for v in Variant))
    if [str(n).strip().lower() for n in names] == ["all"]:
        return list(Variant)
    out: list[Variant] = []
    for n in names:
        v = parse_variant(n)
        if v not in out:
            out.append(v)
    return out


def gated_width(d_model: int, multiple_of: int = 1, ffn_dim_multiplier: float | None = None) -> int:
    """Llama's width rule: int(8/3 d), times the optional multiplier, rounded up to `multiple_of`."""
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class FFNSpec:
    """One FFN layer: variant and sizes. Frozen and validated; `d_ff` is resolved by the width rule.

    Dense variants default to d_ff = 4 d; gated ones to 8/3 d (times `ffn_dim_multiplier`)
    rounded up to `multiple_of`, which defaults to 128 for gated variants so that the
    default widths split into 4-bit groups of 32, 64 and 128 (at d=512: 1408, within 3%
    of the dense FFN's parameters). Pass `multiple_of=1` for the bare 8/3 rule.
    """

    variant: Variant
    d_model: int = 512
    d_ff: int | None = None
    bias: bool | None = None
    multiple_of: int | None = None
    ffn_dim_multiplier: float | None = None
    # A nonlinearity other than the variant's own, for checkpoints whose FFN is a known
    # variant with a different activation (Gemma and gated T5: GeGLU with the tanh GELU).
    # None, or the variant's own activation, means the variant's default (normalised to None
    # so that equal layers compare equal and existing keys and JSON stay unchanged).
    activation_override: Activation | None = None

    def __post_init__(self) -> None:
        variant = parse_variant(self.variant)
        object.__setattr__(self, "variant", variant)
        override = self.activation_override
        if override is not None:
            try:
                override = Activation(getattr(override, "value", override))
            except ValueError:
                raise unknown_choice("activation", override, list(Activation)) from None
            if override == VARIANT_ACTIVATION[variant]:
                override = None
        object.__setattr__(self, "activation_override", override)
        if isinstance(self.d_model, bool) or not isinstance(self.d_model, int) or self.d_model <= 0:
            raise FFNQuantError(f"d_model must be a positive integer, got {self.d_model!r}")
        multiple_of = self.multiple_of
        if multiple_of is None:
            multiple_of = 128 if variant.gated else 1
        if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of <= 0:
            raise FFNQuantError(f"multiple_of must be a positive integer, got {self.multiple_of!r}")
        object.__setattr__(self, "multiple_of", multiple_of)
        mult = self.ffn_dim_multiplier
        if mult is not None and (not isinstance(mult, (int, float)) or not math.isfinite(mult) or mult <= 0):
            raise FFNQuantError(f"ffn_dim_multiplier must be a positive number, got {mult!r}")
        if self.d_ff is None:
            try:
                if variant.gated:
                    d_ff = gated_width(self.d_model, multiple_of, mult)
                else:
                    base = 4 * self.d_model
                    if mult is not None:
                        base = int(mult * base)
                    d_ff = multiple_of * ((base + multiple_of - 1) // multiple_of)
            except OverflowError:  # a huge multiplier makes the float width infinite
                d_ff = None
            if d_ff is None or d_ff <= 0:
                raise FFNQuantError(
                    f"ffn_dim_multiplier {mult!r} at d_model {self.d_model} gives d_ff "
                    f"{'beyond any size' if d_ff is None else d_ff}; choose a multiplier giving d_ff >= 1"
                )
            object.__setattr__(self, "d_ff", d_ff)
        elif isinstance(self.d_ff, bool) or not isinstance(self.d_ff, int) or self.d_ff <= 0:
            raise FFNQuantError(f"d_ff must be a positive integer, got {self.d_ff!r}")
        if self.d_model * self.d_ff > MAX_ELEMENTS:
            # Refused here, before any size arithmetic: torch's int64 byte counts overflow past this.
            raise FFNQuantError(
                f"d_model {self.d_model} x d_ff {self.d_ff} = {self.d_model * self.d_ff:.3g} weights per matrix, "
                f"beyond what any tensor can hold (2**62): choose a smaller d_model or d_ff"
            )
        if self.bias is None:
            object.__setattr__(self, "bias", variant in _BIAS_BY_DEFAULT)
        elif not isinstance(self.bias, bool):
            raise FFNQuantError(f"bias must be true or false, got {self.bias!r}")

    # --- derived facts -------------------------------------------------------------
    @property
    def gated(self) -> bool:
        return self.variant.gated

    @property
    def activation(self) -> Activation:
        """The nonlinearity (the gate's, for gated variants): the override if set, else the variant's."""
        return self.activation_override or VARIANT_ACTIVATION[self.variant]

    @property
    def n_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def sites(self) -> tuple[str, ...]:
        """The tensor sites this variant has (dense variants have no `gate_pre`)."""
        return tuple(s for s in SITES if self.gated or s not in GATED_ONLY_SITES)

    @property
    def weight_names(self) -> tuple[str, ...]:
        return WEIGHTS if self.gated else ("w_up", "w_down")

    @property
    def weight_shapes(self) -> dict[str, tuple[int, int]]:
        """torch.nn.Linear layout: [out_features, in_features]."""
        shapes = {"w_up": (self.d_ff, self.d_model), "w_down": (self.d_model, self.d_ff)}
        if self.gated:
            shapes["w_gate"] = (self.d_ff, self.d_model)
        return {k: shapes[k] for k in self.weight_names}

    @property
    def n_weight_params(self) -> int:
        return self.n_matrices * self.d_model * self.d_ff

    @property
    def n_bias_params(self) -> int:
        if not self.bias:
            return 0
        return (self.n_matrices - 1) * self.d_ff + self.d_model

    @property
    def n_params(self) -> int:
        """Exact parameter count (weights plus biases)."""
        return self.n_weight_params + self.n_bias_params

    @property
    def flops_per_token(self) -> int:
        """Nominal FLOPs per token: 2 per multiply-add of each matmul, 1 per bias add,
        1 per gate product and 1 per nonlinearity element (transcendentals counted as one op)."""
        matmul = 2 * self.n_weight_params
        bias = self.n_bias_params
        gate_mul = self.d_ff if self.gated else 0
        act = _ACT_OPS[self.activation] * self.d_ff
        return matmul + bias + gate_mul + act

    # --- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["variant"] = self.variant.value
        if self.activation_override is None:
            del d["activation_override"]  # specs without an override serialise as before
        else:
            d["activation_override"] = self.activation_override.value
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FFNSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise FFNQuantError(f"unknown FFNSpec field(s) {extra}; valid: {sorted(known)}")
        return cls(**dict(data))

    @property
    def key(self) -> str:
        """A short name for files: variant_d{d}_ff{ff}[_nobias|_bias][_act-{activation}]."""
        default_bias = self.variant in _BIAS_BY_DEFAULT
        suffix = "" if self.bias == default_bias else ("_bias" if self.bias else "_nobias")
        if self.activation_override is not None:
            suffix += f"_act-{self.activation_override.value}"
        return f"{self.variant.value}_d{self.d_model}_ff{self.d_ff}{suffix}"
