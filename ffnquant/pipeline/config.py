"""The run's configuration: `RunConfig`, frozen and validated, and its TOML file.

A config round-trips through a dict and TOML, so a run can be repeated exactly
(`ffnquant run --config reports/run.toml`). Recipe texts are parsed once, here, into `Recipe`s.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import FFNQuantError
from ..recipe import Recipe, as_recipe
from ..spec import FFNSpec, Variant, parse_variants

__all__ = ["CONFIG_VERSION", "DEFAULT_SCHEMES", "DEFAULT_TOKENS", "FLOAT_BASELINES", "RunConfig", "load_config"]

CONFIG_VERSION = 1
# The default set: float baselines, int8 weight-only, static int8 with the best calibrator
# per site, dynamic int8, 4-bit group-wise and bitsandbytes' NF4; smoothed static int8 uses
# `search` (per site by the FFN's output SQNR), because after smoothing a per-tensor histogram
# cannot see the rescaled weight columns and `auto` falls behind (swiglu d=512: 28.8 vs 31.1 dB),
# plus smoothing with rotation, the one recipe that brings geglu's int8 over 30 dB. Dynamic int8 is the
# symmetric per-token scheme, the one a CPU kernel computes (torch._int_mm); uint8 `w8a8-dynamic` has none.
DEFAULT_SCHEMES: tuple[str, ...] = (
    "fp32", "fp16", "w8a16", "w8a8@auto", "w8a8@search+smooth", "w8a8@search+smooth+rotate",
    "w8a8-dynamic-s8", "w4a16-g128", "nf4",
)
# Decode (1, 16) and one prefill block (512): enough to see both regimes within the 5-minute budget.
DEFAULT_TOKENS: tuple[int, ...] = (1, 16, 512)
# What speedups and recommendations are measured against: an unquantized scheme.
FLOAT_BASELINES: tuple[str, ...] = ("fp32", "fp16")


# --- the configuration ---------------------------------------------------------------------

def _tuple_of_str(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.split(",")]
    if not isinstance(value, (list, tuple)):
        raise FFNQuantError(f"{what} must be a list or a comma-separated string, got {value!r}")
    out = tuple(str(v).strip() for v in value if str(v).strip())
    return out


def _recipes(value: Any) -> tuple[Recipe, ...]:
    """Recipes from Recipes or texts (a list, or one comma-separated string): each text parsed once, here."""
    if isinstance(value, Recipe):
        value = [value]
    elif isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)):
        raise FFNQuantError(f"schemes must be a list or a comma-separated string, got {value!r}")
    return tuple(v if isinstance(v, Recipe) else Recipe.parse(str(v)) for v in value
                 if isinstance(v, Recipe) or str(v).strip())


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FFNQuantError(f"{what} must be a positive integer, got {value!r}")
    return value


def _positive_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise FFNQuantError(f"{what} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides a run's numbers (and where it writes). Frozen and validated.

    `runtimes=("available",)` means every runtime that is really available on the machine,
    `("none",)` measures no latency (accuracy only); naming a runtime that is not available is an error. `source` is "gaussian", "llm_like",
    "file:PATH" or a .npy/.safetensors path (see `ffnquant.data.parse_source`).
    """

    variants: tuple[str, ...] = tuple(v.value for v in Variant)
    d_model: int = 512
    d_ff: int | None = None
    multiple_of: int | None = None
    ffn_dim_multiplier: float | None = None
    bias: bool | None = None
    seed: int = 0
    source: str = "llm_like"
    n_outlier_channels: int = 4
    outlier_scale: float = 50.0
    calib_tokens: int = 4096
    eval_tokens: int = 2048
    batch_size: int = 1024
    bins: int = 2048
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    baseline: str = "fp32"
    target_db: float = 30.0
    sensitivity: bool = True
    onnx: bool = True
    runtimes: tuple[str, ...] = ("available",)
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    budget_s: float = 0.04
    out_reports: str = "reports/run"  # git-ignored: a run never replaces the committed reference reports
    out_export: str = "export"
    # A real model's FFN layers side by side with the variants: a local Hugging Face folder, its layers
    # ("0-3", "0,5,7"; None = all), calibration text and held-out evaluation text (None = shipped samples).
    model: str | None = None
    layers: str | None = None
    text: str | None = None
    eval_text: str | None = None
    plan: str | None = None  # an `ffnquant plan` file for `model`: measured end to end beside the single recipes
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.version != CONFIG_VERSION:
            raise FFNQuantError(f"run config version {self.version!r} is not supported (expected {CONFIG_VERSION})")
        set_("variants", tuple(v.value for v in parse_variants(list(_tuple_of_str(self.variants, "variants")) or None)))
        recipes = _recipes(self.schemes)
        names = [r.name for r in recipes]
        if not recipes:
            raise FFNQuantError("schemes must name at least one scheme")
        if len(set(names)) != len(names):
            raise FFNQuantError(f"schemes lists a scheme twice: {', '.join(names)}")
        set_("schemes", recipes)
        runtimes = tuple(r.lower() for r in _tuple_of_str(self.runtimes, "runtimes")) or ("available",)
        if ("available" in runtimes or "none" in runtimes) and len(runtimes) > 1:
            raise FFNQuantError("runtimes: give 'available' or 'none' alone, or a list of runtime names")
        set_("runtimes", runtimes)
        tokens = self.tokens
        if isinstance(tokens, str):
            try:
                tokens = [int(t) for t in tokens.split(",") if t.strip()]
            except ValueError:
                raise FFNQuantError(f"tokens must be comma-separated positive integers, got {self.tokens!r}") from None
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise FFNQuantError(f"tokens must list at least one token count, got {self.tokens!r}")
        set_("tokens", tuple(sorted({_positive_int(t, "tokens") for t in tokens})))
        for name in ("d_model", "calib_tokens", "eval_tokens", "batch_size", "bins", "n_outlier_channels"):
            if name == "n_outlier_channels" and self.n_outlier_channels == 0:
                continue
            _positive_int(getattr(self, name), name)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise FFNQuantError(f"seed must be a non-negative integer, got {self.seed!r}")
        set_("outlier_scale", _positive_float(self.outlier_scale, "outlier_scale"))
        set_("budget_s", _positive_float(self.budget_s, "budget_s"))
        if isinstance(self.target_db, bool) or not isinstance(self.target_db, (int, float)) or not math.isfinite(self.target_db):
            raise FFNQuantError(f"target_db must be a number of dB, got {self.target_db!r}")
        set_("target_db", float(self.target_db))
        for name in ("sensitivity", "onnx"):
            if not isinstance(getattr(self, name), bool):
                raise FFNQuantError(f"{name} must be true or false, got {getattr(self, name)!r}")
        try:
            base_recipe = as_recipe(self.baseline)
        except FFNQuantError as exc:
            raise FFNQuantError(f"baseline: {exc}") from None
        base = base_recipe.name
        if base_recipe.calibrator or base_recipe.has_remedies or base_recipe.scheme not in FLOAT_BASELINES:
            raise FFNQuantError(f"baseline {base!r} must be a float scheme (speedups are measured against it); "
                                f"valid: {', '.join(FLOAT_BASELINES)}")
        if base not in names:
            raise FFNQuantError(f"baseline {base!r} must be one of the schemes ({', '.join(names)})")
        set_("baseline", base)
        for name in ("out_reports", "out_export", "source"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise FFNQuantError(f"{name} must be a non-empty string, got {value!r}")
        if self.d_ff is not None and self.ffn_dim_multiplier is not None:
            raise FFNQuantError("d_ff and ffn_dim_multiplier are exclusive: give the width or the rule's multiplier")
        self._check_model_fields()
        self.specs()  # validates the sizes now, not halfway through a run
        self.token_source()

    def _check_model_fields(self) -> None:
        layers = self.layers
        if isinstance(layers, (list, tuple)):  # TOML/JSON lists of indices read as the CLI's "0,5,7"
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
                raise FFNQuantError(f"layers must be a string like '0-3' or a list of layer indices, got {layers!r}")
            layers = ",".join(str(i) for i in layers)
        elif isinstance(layers, int) and not isinstance(layers, bool):
            layers = str(layers)
        if isinstance(layers, str) and layers.strip().lower() in ("", "all"):
            layers = None
        object.__setattr__(self, "layers", layers)
        for name in ("model", "layers", "text", "eval_text", "plan"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise FFNQuantError(f"{name} must be a non-empty string, got {value!r}")
        if self.model is None:
            given = [n for n in ("layers", "text", "eval_text", "plan") if getattr(self, n) is not None]
            if given:
                raise FFNQuantError(f"{', '.join(given)} select(s) a real model's layers or texts: give model too")

    # --- derived -------------------------------------------------------------------
    @property
    def recipes(self) -> tuple[Recipe, ...]:
        """The schemes as parsed Recipes (parsed once, when the config was made)."""
        return self.schemes

    @property
    def baseline_recipe(self) -> Recipe:
        return next(r for r in self.schemes if r.name == self.baseline)

    def specs(self) -> list[FFNSpec]:
        return [
            FFNSpec(v, d_model=self.d_model, d_ff=self.d_ff, bias=self.bias, multiple_of=self.multiple_of,
                    ffn_dim_multiplier=self.ffn_dim_multiplier)
            for v in self.variants
        ]

    def token_source(self):
        """The `ffnquant.data.TokenSource` the config names (validated; files are read later)."""
        from ..data import parse_source

        return parse_source(self.source, seed=self.seed, n_outlier_channels=self.n_outlier_channels,
                            outlier_scale=self.outlier_scale)

    # --- presets and serialisation ---------------------------------------------------
    @classmethod
    def tiny(cls, **changes: Any) -> "RunConfig":
        """A seconds-long configuration for tests and smoke runs: d_model 64, 3 variants, few tokens."""
        base = dict(variants=("relu", "gelu", "swiglu"), d_model=64, calib_tokens=512, eval_tokens=256, batch_size=256,
                    bins=512, schemes=("fp32", "w8a8@auto", "w8a8@auto+smooth", "w8a8-dynamic-s8", "w4a16-g32"),
                    tokens=(1, 64), budget_s=0.005)
        base.update(changes)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["schemes"] = [r.name for r in self.schemes]  # the text form: TOML and JSON hold strings
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise FFNQuantError(f"unknown run config key(s) {', '.join(extra)}; valid: {', '.join(sorted(known))}")
        return cls(**dict(data))

    def to_toml(self) -> str:
        """TOML text that `load_config` reads back to an equal config (None fields are left out:
        TOML has no null, and absent means the default None)."""
        import tomli_w  # the well-kept TOML writer; tomllib only reads

        data = {k: v for k, v in self.to_dict().items() if v is not None}
        return "# ffnquant run configuration; repeat the run with: ffnquant run --config THIS_FILE\n" + tomli_w.dumps(data)

    def with_(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)


def load_config(path: str | os.PathLike) -> RunConfig:
    """Read a RunConfig from a TOML file; unreadable or invalid files raise FFNQuantError naming the file."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    p = Path(path)
    if p.exists() and not p.is_file():
        # a FIFO or a device would block the read forever; a folder cannot be parsed
        raise FFNQuantError(f"config file {str(p)!r} is not a regular file; give a TOML file written by 'ffnquant run'")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FFNQuantError(f"config file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FFNQuantError(f"cannot read config file {str(p)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise FFNQuantError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    try:
        return RunConfig.from_dict(data)
    except FFNQuantError as exc:
        raise FFNQuantError(f"config file {str(p)!r}: {exc}") from None
    # anything else (a TypeError, say) is a bug in ffnquant, not in the file: it is not reworded as one


