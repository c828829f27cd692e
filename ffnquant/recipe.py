"""`Recipe`: what one quantized configuration of an FFN is, from the command line to the file name.

A recipe is a scheme preset (`ffnquant.schemes`), an optional calibrator override and the exact
remedies applied to the float model first: `SCHEME[@CALIBRATOR][+smooth[=ALPHA]][+rotate]`, e.g.
`w8a8@search+smooth+rotate`. It is parsed once, at the edge (CLI flags, run.toml, the Python API),
and only `Recipe` objects travel further: `scheme()` gives the resolved `Scheme`, `slug` is the one
source of artifact file names, `to_dict`/`from_dict` the JSON form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import FFNQuantError, unknown_choice

__all__ = ["DEFAULT_SMOOTH_ALPHA", "GRAMMAR", "Recipe", "parse_recipe", "as_recipe"]

DEFAULT_SMOOTH_ALPHA = 0.5
GRAMMAR = "SCHEME[@CALIBRATOR][+smooth[=ALPHA]][+rotate][+float=SITE]"
REMEDIES = ("smooth", "smooth=ALPHA", "rotate", "float=input", "float=hidden")
# A site kept in float: the matrices reading it stay unquantized (16-bit when deployed) and so does the site itself.
FLOAT_SITES = ("input", "hidden")


def _exact(x: float) -> str:
    """The short form of x ('0.3', '1') where it reads back to the same float, else every digit needed:
    run.toml stores recipes as text, and a rounded strength would not repeat the run."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


@dataclass(frozen=True)
class Recipe:
    """A scheme preset, an optional calibrator override and remedies. Frozen and validated.

    `Recipe("w8a8", "auto", smooth=0.5)` is `w8a8@auto+smooth`; `str()` gives that text back and
    `Recipe.parse(str(r)) == r`. Invalid combinations (a calibrator on a scheme without static
    activation ranges, remedies on a float scheme) raise FFNQuantError naming what is valid.
    """

    scheme: str
    calibrator: str | None = None
    smooth: float | None = None
    rotate: bool = False
    keep_float: str | None = None  # 'input' (w_gate, w_up) or 'hidden' (w_down): left unquantized, with its site

    def __post_init__(self) -> None:
        from .schemes import get_scheme

        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if not isinstance(self.scheme, str) or not self.scheme.strip():
            raise FFNQuantError(f"recipe: scheme must be a preset name, got {self.scheme!r}")
        set_("scheme", self.scheme.strip().lower())
        sch = get_scheme(self.scheme)  # an unknown name lists the presets
        if self.calibrator is not None:
            from .calibrate import parse_calibrator

            if not isinstance(self.calibrator, str) or not self.calibrator.strip():
                raise FFNQuantError(f"recipe {self.scheme!r}: calibrator must be a name, got {self.calibrator!r}")
            set_("calibrator", self.calibrator.strip().lower())
            parse_calibrator(self.calibrator)
            if not sch.static_activations:
                raise FFNQuantError(f"recipe {self.name!r}: {self.scheme} has no static activation ranges to calibrate")
        if self.smooth is not None:
            if isinstance(self.smooth, bool) or not isinstance(self.smooth, (int, float)) or not 0.0 <= self.smooth <= 1.0:
                raise FFNQuantError(f"recipe {self.scheme!r}: smooth strength must be a number in [0, 1], got {self.smooth!r}")
            set_("smooth", float(self.smooth))
        if not isinstance(self.rotate, bool):
            raise FFNQuantError(f"recipe {self.scheme!r}: rotate must be true or false, got {self.rotate!r}")
        if self.has_remedies and sch.weight_dtype.is_float:
            raise FFNQuantError(f"recipe {self.name!r}: remedies apply to quantized schemes, not {self.scheme}")
        if self.keep_float is not None:
            if self.keep_float not in FLOAT_SITES:
                raise unknown_choice(f"recipe {self.scheme!r}: float site", self.keep_float, FLOAT_SITES)
            if sch.weight_dtype.is_float:
                raise FFNQuantError(f"recipe {self.name!r}: {self.scheme} is float already; +float=SITE keeps one site "
                                    "of a quantized scheme in float")

    # --- text forms -------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The canonical text, e.g. 'w8a8@auto+smooth+rotate' (what `parse` reads back)."""
        out = self.scheme + (f"@{self.calibrator}" if self.calibrator else "")
        if self.smooth is not None:
            out += "+smooth" + ("" if self.smooth == DEFAULT_SMOOTH_ALPHA else f"={_exact(self.smooth)}")
        if self.rotate:
            out += "+rotate"
        if self.keep_float:
            out += f"+float={self.keep_float}"
        return out

    def __str__(self) -> str:
        return self.name

    @property
    def label(self) -> str:
        """Human label, e.g. 'w8a8 (auto) + smooth 0.5'."""
        out = self.scheme + (f" ({self.calibrator})" if self.calibrator else "")
        if self.smooth is not None:
            out += f" + smooth {self.smooth:g}"
        if self.rotate:
            out += " + rotate"
        if self.keep_float:
            out += f", {self.keep_float} in float"
        return out

    @property
    def remedy_slug(self) -> str:
        """The remedies as a file-name part: '' or e.g. 'smooth0.5-rotate'."""
        parts = ([f"smooth{_exact(self.smooth)}"] if self.smooth is not None else []) + (["rotate"] if self.rotate else [])
        return "-".join(parts)

    @property
    def slug(self) -> str:
        """The file-name form, the only source of artifact names: 'w8a8', 'w8a8-auto', 'w8a8-search.smooth0.5-rotate'.

        Distinct recipes have distinct slugs (calibrator text is kept, only characters a file
        name cannot carry portably are replaced)."""
        head = self.scheme + (f"-{self.calibrator}" if self.calibrator else "")
        head = re.sub(r"[^a-z0-9._-]", lambda m: "p" if m.group(0) == ":" else "_", head)
        return head + (f".{self.remedy_slug}" if self.remedy_slug else "") + (
            f".float-{self.keep_float}" if self.keep_float else "")

    # --- what it means ------------------------------------------------------------------
    @property
    def has_remedies(self) -> bool:
        return self.smooth is not None or self.rotate

    @property
    def is_float(self) -> bool:
        """True for the unquantized presets (fp32, fp16): baselines, not quantized recipes."""
        return self.resolve().weight_dtype.is_float

    def resolve(self):
        """The `Scheme` this recipe quantizes with: the preset, with the calibrator override applied."""
        from .schemes import get_scheme

        sch = get_scheme(self.scheme)
        return sch.with_(calibrator=self.calibrator) if self.calibrator else sch

    def plain(self) -> "Recipe":
        """The same scheme and calibrator (and float site) without remedies (what a remedy's gain is measured
        against)."""
        return Recipe(self.scheme, self.calibrator, keep_float=self.keep_float)

    def quantized_parts(self, spec: Any) -> tuple[list[str], list[str]]:
        """(weights, sites) this recipe quantizes on `spec`: the scheme's, less the float site and its matrices."""
        from .fakequant import ACT_SITES, WEIGHT_INPUT_SITE

        sch = self.resolve()
        weights = [w for w in spec.weight_names if sch.quantizes_weights and WEIGHT_INPUT_SITE[w] != self.keep_float]
        sites = [s for s in ACT_SITES if sch.quantizes_activations and s != self.keep_float]
        return weights, sites

    def check_fits(self, spec: Any) -> None:
        """Raise FFNQuantError when the recipe cannot apply to `spec` (group size vs widths)."""
        from .schemes import check_scheme_fits

        check_scheme_fits(self.resolve(), spec)

    # --- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {"scheme": self.scheme, "calibrator": self.calibrator, "smooth": self.smooth, "rotate": self.rotate}
        if self.keep_float:  # only when set: the JSON of every recipe without it stays as it was
            out["keep_float"] = self.keep_float
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Recipe":
        known = {"scheme", "calibrator", "smooth", "rotate", "keep_float"}
        extra = sorted(set(data) - known)
        if extra:
            raise FFNQuantError(f"unknown recipe field(s) {', '.join(extra)}; valid: {', '.join(sorted(known))}")
        if "scheme" not in data:
            raise FFNQuantError("a recipe needs a scheme")
        return cls(**dict(data))

    @classmethod
    def parse(cls, text: str) -> "Recipe":
        """Parse `SCHEME[@CALIBRATOR][+smooth[=ALPHA]][+rotate][+float=SITE]` (any letter case, spaces allowed)."""
        raw = str(text).strip()
        if not raw:
            raise FFNQuantError("empty scheme name")
        head, *mods = raw.split("+")
        scheme, at, calibrator = head.partition("@")
        scheme, calibrator = scheme.strip().lower(), calibrator.strip().lower() or None
        if not scheme:
            raise FFNQuantError(f"scheme {raw!r}: no scheme name before '@' or '+'; the form is {GRAMMAR}")
        if at and calibrator is None:
            from .calibrate import calibrator_names

            raise FFNQuantError(f"scheme {raw!r}: '@' must be followed by a calibrator; valid: {', '.join(calibrator_names())}")
        smooth: float | None = None
        rotate = False
        keep_float: str | None = None
        seen: set[str] = set()
        for mod in mods:
            key, _, value = mod.strip().lower().partition("=")
            if key in seen:
                # "+smooth+smooth=0.3" would silently keep the last value: say which one was meant instead
                raise FFNQuantError(f"scheme {raw!r}: remedy {key!r} is given twice; give each remedy at most once")
            seen.add(key)
            if key == "smooth":
                try:
                    smooth = float(value) if value else DEFAULT_SMOOTH_ALPHA
                except ValueError:
                    raise FFNQuantError(f"scheme {raw!r}: smooth strength must be a number, got {value!r}") from None
                if not (0.0 <= smooth <= 1.0):
                    raise FFNQuantError(f"scheme {raw!r}: smooth strength must be in [0, 1], got {smooth:g}")
            elif key == "rotate" and not value:
                rotate = True
            elif key == "float" and value.strip() in FLOAT_SITES:
                keep_float = value.strip()
            else:
                raise unknown_choice(f"remedy in {raw!r}", mod, REMEDIES)
        try:
            return cls(scheme, calibrator, smooth, rotate, keep_float)
        except FFNQuantError as exc:
            msg = str(exc)
            # name the text the user typed, not the canonical form
            raise FFNQuantError(msg if raw in msg else f"scheme {raw!r}: {msg}") from None


def parse_recipe(text: str) -> Recipe:
    """`Recipe.parse`: the one place recipe text becomes a Recipe."""
    return Recipe.parse(text)


def as_recipe(value: "Recipe | str") -> Recipe:
    """A Recipe as given, or parsed from its text (for the Python API's convenience)."""
    if isinstance(value, Recipe):
        return value
    if isinstance(value, str):
        return Recipe.parse(value)
    raise FFNQuantError(f"a recipe is a Recipe or text like 'w8a8@auto+smooth', got {type(value).__name__}")
