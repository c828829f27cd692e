"""`Recipe`: what one quantized configuration of an FFN is, from the command line to the file name.

A recipe is a scheme preset (`ffnquant.schemes`), an optional calibrator override and an ordered tuple
of transforms (`Smooth`, `Rotate`, `KeepFloat`), kept in the order they apply. Its one text form is
`GRAMMAR`, generated from the transform registry, e.g. `w8a8@search+smooth+rotate`. It is parsed once,
at the edge (CLI flags, run.toml, the Python API), and only `Recipe` objects travel further: `resolve()`
gives the `Scheme`, `slug` is the one source of artifact file names, `to_dict`/`from_dict` the JSON form.

AWQ is a scheme (`w4a16-g128-awq`), not a transform: its scales are searched per weight by its method
handler while the weights are rounded, not applied to the float model beforehand.

A new transform is one class: a frozen dataclass subclass of `Transform` declaring its token, grammar
fragment, rank and text/label/slug/JSON forms, registered with `register_transform`; a remedy
(`remedy = True`) also says in `apply` how it rewrites the float FFN (`quantization.prepare` calls it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping

from .errors import FFNQuantError, unknown_choice

if TYPE_CHECKING:  # annotations only
    from .schemes import Scheme
    from .spec import FFNSpec

__all__ = ["DEFAULT_SMOOTH_ALPHA", "GRAMMAR", "FLOAT_SITES", "Transform", "Smooth", "Rotate", "KeepFloat",
           "TRANSFORMS", "register_transform", "unregister_transform", "canonical_transforms", "remedy_slug",
           "Recipe", "parse_recipe", "as_recipe"]

DEFAULT_SMOOTH_ALPHA = 0.5
# A site kept in float: the matrices reading it stay unquantized (16-bit when deployed) and so does the site itself.
FLOAT_SITES = ("input", "hidden")
_UNSET: Any = type("_Unset", (), {"__repr__": lambda self: "<unset>"})()  # a keyword not given (None means "without")


def _exact(x: float) -> str:
    """The short form of x ('0.3', '1') where it reads back to the same float, else every digit needed:
    run.toml stores recipes as text, and a rounded strength would not repeat the run."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


# =====================================================================================
# Transforms: each declares every form it takes in one class
# =====================================================================================

@dataclass(frozen=True)
class Transform:
    """One step of a recipe beyond its scheme. Subclasses are frozen dataclasses validated on construction.

    Class attributes: `token` (its word in the text and registry key), `grammar` (its fragment of GRAMMAR),
    `forms` (the texts it accepts, for errors), `rank` (its place in the canonical order, which is the order
    they apply in), `key` (its `Recipe(...)` keyword and `to_dict` key), `absent` (that keyword's value
    without it), `always_in_json` (written as `absent` when missing, for the JSON of older transforms),
    `remedy` (it changes the float model before quantization, so `quantization.prepare` applies it).
    """

    token: ClassVar[str]
    grammar: ClassVar[str]
    forms: ClassVar[tuple[str, ...]]
    rank: ClassVar[int]
    key: ClassVar[str]
    absent: ClassVar[Any] = False  # a flag's; a transform with a value is absent as None
    always_in_json: ClassVar[bool] = False
    remedy: ClassVar[bool] = False
    # whether applying it reads the calibration text (smoothing's activation maxima do; a rotation does not)
    reads_data: ClassVar[bool] = True

    @classmethod
    def parse(cls, value: str) -> "Transform":
        """The transform from the text after its token's '=' ('' when there is none)."""
        if value:
            raise cls.bad_form(value)
        return cls()

    @classmethod
    def bad_form(cls, value: str) -> FFNQuantError:
        """The error for text this transform does not take, listing the forms it does."""
        return unknown_choice("remedy", f"{cls.token}={value}" if value else cls.token, cls.forms)

    @classmethod
    def from_value(cls, value: Any) -> "Transform | None":
        """The transform from its `Recipe(...)` keyword / JSON value (None where the value is `absent`)."""
        if value == cls.absent and type(value) is type(cls.absent):
            return None
        if value is True:
            return cls()
        raise FFNQuantError(f"{cls.key} must be true or false, got {value!r}")

    @property
    def value(self) -> Any:
        """Its `Recipe(...)` keyword / JSON value (what `from_value` reads back)."""
        return True

    @property
    def text(self) -> str:
        """Its canonical text, without the leading '+'."""
        return self.token

    @property
    def label(self) -> str:
        """Its part of `Recipe.label`, with its separator."""
        return f" + {self.token}"

    @property
    def slug(self) -> str:
        """Its part of a file name: remedies' parts are joined by '-', any other is a '.'-part of its own."""
        return self.token

    def check(self, recipe: "Recipe", scheme: Scheme) -> None:
        """Raise FFNQuantError where it cannot apply to `recipe`'s resolved `scheme`."""
        if self.remedy and scheme.weight_dtype.is_float:
            raise FFNQuantError(f"recipe {recipe.name!r}: remedies apply to quantized schemes, not {recipe.scheme}")

    def apply(self, model: Any, batches: Any, *, original: Any, smooth_sites: Any = None, bins: int | None = None):
        """A remedy's exact float rewrite of `model` (the FFN as the steps before it left it; `original` the FFN
        before any step), profiled on the calibration `batches` where it needs ranges: (new model, its
        `remedies.RemedyRecord`). `quantization.prepare` calls it for each remedy of a recipe, in order."""
        raise FFNQuantError(f"remedy {self.text!r} has no step on a float FFN; valid: "
                            f"{', '.join(c.token for c in TRANSFORMS.values() if c.remedy)}")


TRANSFORMS: dict[str, type[Transform]] = {}  # by token, in rank order
GRAMMAR = ""
REMEDIES: tuple[str, ...] = ()


def _refresh() -> None:
    """Rebuild the registry's order, GRAMMAR and the list of forms from the registered classes."""
    global GRAMMAR, REMEDIES
    ordered = sorted(TRANSFORMS.values(), key=lambda c: c.rank)
    TRANSFORMS.clear()
    TRANSFORMS.update((c.token, c) for c in ordered)
    GRAMMAR = "SCHEME[@CALIBRATOR]" + "".join(f"[{c.grammar}]" for c in ordered)
    REMEDIES = tuple(form for c in ordered for form in c.forms)


def register_transform(cls: type[Transform]) -> type[Transform]:
    """Register a Transform class (a decorator): its token, keyword and rank must be new."""
    if not (isinstance(cls, type) and issubclass(cls, Transform)):
        raise FFNQuantError(f"register_transform: {cls!r} is not a Transform class")
    for attr in ("token", "key", "rank"):
        taken = {getattr(c, attr): c for c in TRANSFORMS.values()}
        if getattr(cls, attr) in taken:
            raise FFNQuantError(f"register_transform: {cls.__name__}'s {attr} {getattr(cls, attr)!r} is taken by "
                                f"{taken[getattr(cls, attr)].__name__}")
    if cls.key in {"scheme", "calibrator", "transforms"}:
        raise FFNQuantError(f"register_transform: {cls.__name__}'s key {cls.key!r} is a Recipe field")
    TRANSFORMS[cls.token] = cls
    _refresh()
    return cls


def unregister_transform(token: str) -> None:
    """Remove a registered transform (tests register toys and take them out again)."""
    if token not in TRANSFORMS:
        raise unknown_choice("transform", token, TRANSFORMS)
    del TRANSFORMS[token]
    _refresh()


@register_transform
@dataclass(frozen=True)
class Smooth(Transform):
    """SmoothQuant: activation outliers moved into the weights with strength `alpha` (exact, folded)."""

    alpha: float = DEFAULT_SMOOTH_ALPHA

    token: ClassVar[str] = "smooth"
    grammar: ClassVar[str] = "+smooth[=ALPHA]"
    forms: ClassVar[tuple[str, ...]] = ("smooth", "smooth=ALPHA")
    rank: ClassVar[int] = 10
    key: ClassVar[str] = "smooth"
    absent: ClassVar[Any] = None
    always_in_json: ClassVar[bool] = True
    remedy: ClassVar[bool] = True

    def __post_init__(self) -> None:
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            raise FFNQuantError(f"smooth strength must be a number in [0, 1], got {a!r}")
        if not 0.0 <= a <= 1.0:
            raise FFNQuantError(f"smooth strength must be in [0, 1], got {_exact(a)}")
        object.__setattr__(self, "alpha", float(a))

    @classmethod
    def parse(cls, value: str) -> "Smooth":
        if not value:
            return cls()
        try:
            alpha = float(value)
        except ValueError:
            raise FFNQuantError(f"smooth strength must be a number, got {value!r}") from None
        return cls(alpha)

    @classmethod
    def from_value(cls, value: Any) -> "Smooth | None":
        return None if value is None else cls(value)

    @property
    def value(self) -> float:
        return self.alpha

    @property
    def text(self) -> str:
        return "smooth" if self.alpha == DEFAULT_SMOOTH_ALPHA else f"smooth={_exact(self.alpha)}"

    @property
    def label(self) -> str:
        return f" + smooth {self.alpha:g}"

    @property
    def slug(self) -> str:
        return f"smooth{_exact(self.alpha)}"

    def apply(self, model: Any, batches: Any, *, original: Any, smooth_sites: Any = None, bins: int | None = None,
              ranges: Any = None):
        """Smooth at `alpha` on the sites given, else every site where the fold is exact (a ReLU-family hidden);
        the ranges are those of `model` as it is before this step (`ranges()`, when given, returns them already
        profiled: `quantization.prepare` shares one profile between the recipes of a layer)."""
        from .numerics import remedies as R
        from .numerics.observe import profile

        table0 = (ranges() if ranges is not None
                  else profile(model, batches, sites=["input", "hidden"], weights=False, bins=bins))
        sites = tuple(smooth_sites) if smooth_sites else tuple(s for s, ok in R.smooth_exact_for(model).items() if ok)
        work, rec = R.smooth(model, table0, self.alpha, sites)
        if smooth_sites is None and not R.smooth_exact_for(original)["hidden"]:
            act = original.spec.activation.value
            rec.note = f"hidden not smoothed: {act} is not positively homogeneous (fold would not be exact)"
        return work, rec


@register_transform
@dataclass(frozen=True)
class Rotate(Transform):
    """A block-Hadamard rotation of the FFN's input and hidden spaces (exact, spreads outliers)."""

    token: ClassVar[str] = "rotate"
    grammar: ClassVar[str] = "+rotate"
    forms: ClassVar[tuple[str, ...]] = ("rotate",)
    rank: ClassVar[int] = 20
    key: ClassVar[str] = "rotate"
    absent: ClassVar[Any] = False
    always_in_json: ClassVar[bool] = True
    remedy: ClassVar[bool] = True
    reads_data: ClassVar[bool] = False  # a fixed block-Hadamard

    def apply(self, model: Any, batches: Any, *, original: Any, smooth_sites: Any = None, bins: int | None = None,
              ranges: Any = None):
        from .numerics import remedies as R

        return R.rotate(model)


@register_transform
@dataclass(frozen=True)
class KeepFloat(Transform):
    """One site of a quantized scheme left in float: 'input' (w_gate, w_up) or 'hidden' (w_down) and the site."""

    site: str

    token: ClassVar[str] = "float"
    grammar: ClassVar[str] = "+float=SITE"
    forms: ClassVar[tuple[str, ...]] = tuple(f"float={s}" for s in FLOAT_SITES)
    rank: ClassVar[int] = 90  # last: it decides what is quantized, after every remedy has changed the model
    key: ClassVar[str] = "keep_float"
    absent: ClassVar[Any] = None
    always_in_json: ClassVar[bool] = False  # the JSON of every recipe without it stays as it was
    reads_data: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.site not in FLOAT_SITES:
            raise unknown_choice("float site", self.site, FLOAT_SITES)

    @classmethod
    def parse(cls, value: str) -> "KeepFloat":
        if value.strip() not in FLOAT_SITES:
            raise cls.bad_form(value)
        return cls(value.strip())

    @classmethod
    def from_value(cls, value: Any) -> "KeepFloat | None":
        return None if value is None else cls(value)

    @property
    def value(self) -> str:
        return self.site

    @property
    def text(self) -> str:
        return f"float={self.site}"

    @property
    def label(self) -> str:
        return f", {self.site} in float"

    @property
    def slug(self) -> str:
        return f"float-{self.site}"

    def check(self, recipe: "Recipe", scheme: Scheme) -> None:
        if scheme.weight_dtype.is_float:
            raise FFNQuantError(f"recipe {recipe.name!r}: {recipe.scheme} is float already; {self.grammar} "
                                "keeps one site of a quantized scheme in float")


def canonical_transforms(transforms: Iterable[Transform]) -> tuple[Transform, ...]:
    """`transforms` in the order they apply (by rank), each registered and given at most once."""
    items = tuple(transforms)
    for t in items:
        if not isinstance(t, Transform) or TRANSFORMS.get(type(t).token) is not type(t):
            raise FFNQuantError(f"transforms must be registered Transform objects ({', '.join(TRANSFORMS)}), got {t!r}")
    seen: set[str] = set()
    for t in items:
        if t.token in seen:
            # "+smooth+smooth=0.3" would silently keep the last value: say which one was meant instead
            raise FFNQuantError(f"remedy {t.token!r} is given twice; give each remedy at most once")
        seen.add(t.token)
    return tuple(sorted(items, key=lambda t: t.rank))


def remedy_slug(transforms: Iterable[Transform]) -> str:
    """The remedies among `transforms` as a file-name part: '' or e.g. 'smooth0.5-rotate'."""
    return "-".join(t.slug for t in transforms if t.remedy)


# =====================================================================================
# Recipe
# =====================================================================================

@dataclass(frozen=True, init=False)
class Recipe:
    """A scheme preset, an optional calibrator override and transforms in canonical order. Frozen and validated.

    `Recipe("w8a8", "auto", smooth=0.5)` is `Recipe("w8a8", "auto", transforms=(Smooth(0.5),))`, i.e.
    `w8a8@auto+smooth`; `str()` gives that text back and `Recipe.parse(str(r)) == r`. Each transform's
    keyword (`smooth`, `rotate`, `keep_float`), where given, sets that transform (None or False removes
    it) over `transforms`, so `dataclasses.replace(r, keep_float=None)` drops the float site. Invalid
    combinations (a calibrator on a scheme without static activation ranges, remedies on a float scheme)
    raise FFNQuantError naming what is valid.
    """

    scheme: str
    calibrator: str | None
    transforms: tuple[Transform, ...]

    def __init__(self, scheme: str, calibrator: str | None = None, smooth: Any = _UNSET, rotate: Any = _UNSET,
                 keep_float: Any = _UNSET, *, transforms: Iterable[Transform] = (), **values: Any) -> None:
        from .schemes import get_scheme

        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if not isinstance(scheme, str) or not scheme.strip():
            raise FFNQuantError(f"recipe: scheme must be a preset name, got {scheme!r}")
        set_("scheme", scheme.strip().lower())
        set_("calibrator", calibrator)
        set_("transforms", ())
        by_key = {c.key: c for c in TRANSFORMS.values()}
        values.update({k: v for k, v in (("smooth", smooth), ("rotate", rotate), ("keep_float", keep_float))
                       if v is not _UNSET})
        for k in values:
            if k not in by_key:
                raise unknown_choice(f"recipe {self.scheme!r}: keyword", k, ["scheme", "calibrator", "transforms", *by_key])
        overridden = {by_key[k] for k in values}
        try:
            given = [t for t in transforms if type(t) not in overridden]
            given += [t for k, v in values.items() if (t := by_key[k].from_value(v)) is not None]
            set_("transforms", canonical_transforms(given))
        except FFNQuantError as exc:
            raise FFNQuantError(f"recipe {self.scheme!r}: {exc}") from None
        sch = get_scheme(self.scheme)  # an unknown name lists the presets
        if self.calibrator is not None:
            from .numerics.calibrate import parse_calibrator

            if not isinstance(self.calibrator, str) or not self.calibrator.strip():
                raise FFNQuantError(f"recipe {self.scheme!r}: calibrator must be a name, got {self.calibrator!r}")
            set_("calibrator", self.calibrator.strip().lower())
            parse_calibrator(self.calibrator)
            if not sch.static_activations:
                raise FFNQuantError(f"recipe {self.name!r}: {self.scheme} has no static activation ranges to calibrate")
        for t in self.transforms:
            t.check(self, sch)

    # --- the transforms -----------------------------------------------------------------
    def transform(self, cls: type[Transform]) -> Transform | None:
        """This recipe's transform of class `cls`, or None."""
        return next((t for t in self.transforms if type(t) is cls), None)

    @property
    def remedies(self) -> tuple[Transform, ...]:
        """The transforms applied to the float model before quantization, in order (what `prepare` applies)."""
        return tuple(t for t in self.transforms if t.remedy)

    @property
    def smooth(self) -> float | None:
        """The smoothing strength, or None without smoothing."""
        t = self.transform(Smooth)
        return None if t is None else t.alpha

    @property
    def rotate(self) -> bool:
        return self.transform(Rotate) is not None

    @property
    def keep_float(self) -> str | None:
        """'input' (w_gate, w_up) or 'hidden' (w_down): left unquantized, with its site; or None."""
        t = self.transform(KeepFloat)
        return None if t is None else t.site

    # --- text forms -------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The canonical text, e.g. 'w8a8@auto+smooth+rotate' (what `parse` reads back)."""
        return self.scheme + (f"@{self.calibrator}" if self.calibrator else "") + "".join(f"+{t.text}" for t in self.transforms)

    def __str__(self) -> str:
        return self.name

    @property
    def label(self) -> str:
        """Human label, e.g. 'w8a8 (auto) + smooth 0.5'."""
        return self.scheme + (f" ({self.calibrator})" if self.calibrator else "") + "".join(t.label for t in self.transforms)

    @property
    def remedy_slug(self) -> str:
        """The remedies as a file-name part: '' or e.g. 'smooth0.5-rotate'."""
        return remedy_slug(self.transforms)

    @property
    def slug(self) -> str:
        """The file-name form, the only source of artifact names: 'w8a8', 'w8a8-auto', 'w8a8-search.smooth0.5-rotate'.

        Distinct recipes have distinct slugs (calibrator text is kept, only characters a file
        name cannot carry portably are replaced)."""
        head = self.scheme + (f"-{self.calibrator}" if self.calibrator else "")
        head = re.sub(r"[^a-z0-9._-]", lambda m: "p" if m.group(0) == ":" else "_", head)
        parts = [self.remedy_slug] + [t.slug for t in self.transforms if not t.remedy]
        return head + "".join(f".{p}" for p in parts if p)

    # --- what it means ------------------------------------------------------------------
    @property
    def has_remedies(self) -> bool:
        return bool(self.remedies)

    @property
    def is_float(self) -> bool:
        """True for the unquantized presets (fp32, fp16): baselines, not quantized recipes."""
        return self.resolve().weight_dtype.is_float

    @property
    def reads_calibration(self) -> bool:
        """Whether quantizing under this recipe reads the calibration text: static activation ranges, second-order
        statistics (GPTQ, AWQ) or a transform computed from data (smoothing). Weight-only rounding and per-token
        activations quantize to the same model whatever the text."""
        if self.is_float:
            return False
        scheme = self.resolve()
        return scheme.static_activations or scheme.needs_hessians or any(t.reads_data for t in self.transforms)

    def resolve(self):
        """The `Scheme` this recipe quantizes with: the preset, with the calibrator override applied."""
        from .schemes import get_scheme

        sch = get_scheme(self.scheme)
        return sch.with_(calibrator=self.calibrator) if self.calibrator else sch

    def plain(self) -> "Recipe":
        """The same scheme and calibrator (and float site) without remedies (what a remedy's gain is measured
        against)."""
        return Recipe(self.scheme, self.calibrator, transforms=[t for t in self.transforms if not t.remedy])

    def quantized_parts(self, spec: FFNSpec) -> tuple[list[str], list[str]]:
        """(weights, sites) this recipe quantizes on `spec`: the scheme's, less the float site and its matrices."""
        from .methods.fakequant import ACT_SITES, WEIGHT_INPUT_SITE

        sch = self.resolve()
        weights = [w for w in spec.weight_names if sch.quantizes_weights and WEIGHT_INPUT_SITE[w] != self.keep_float]
        sites = [s for s in ACT_SITES if sch.quantizes_activations and s != self.keep_float]
        return weights, sites

    def check_fits(self, spec: FFNSpec) -> None:
        """Raise FFNQuantError when the recipe cannot apply to `spec` (group size vs widths)."""
        from .schemes import check_scheme_fits

        check_scheme_fits(self.resolve(), spec)

    # --- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scheme": self.scheme, "calibrator": self.calibrator}
        for cls in TRANSFORMS.values():
            t = self.transform(cls)
            if t is not None or cls.always_in_json:
                out[cls.key] = cls.absent if t is None else t.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Recipe":
        known = {"scheme", "calibrator", *(c.key for c in TRANSFORMS.values())}
        extra = sorted(set(data) - known)
        if extra:
            raise FFNQuantError(f"unknown recipe field(s) {', '.join(extra)}; valid: {', '.join(sorted(known))}")
        if "scheme" not in data:
            raise FFNQuantError("a recipe needs a scheme")
        return cls(**dict(data))

    @classmethod
    def parse(cls, text: str) -> "Recipe":
        """Parse recipe text, `GRAMMAR` (any letter case, spaces allowed, transforms in any order)."""
        raw = str(text).strip()
        if not raw:
            raise FFNQuantError("empty scheme name")
        head, *mods = raw.split("+")
        scheme, at, calibrator = head.partition("@")
        scheme, calibrator = scheme.strip().lower(), calibrator.strip().lower() or None
        if not scheme:
            raise FFNQuantError(f"scheme {raw!r}: no scheme name before '@' or '+'; the form is {GRAMMAR}")
        if at and calibrator is None:
            from .numerics.calibrate import calibrator_names

            raise FFNQuantError(f"scheme {raw!r}: '@' must be followed by a calibrator; valid: {', '.join(calibrator_names())}")
        transforms: list[Transform] = []
        seen: set[str] = set()
        for mod in mods:
            key, _, value = mod.strip().lower().partition("=")
            if key in seen:
                raise FFNQuantError(f"scheme {raw!r}: remedy {key!r} is given twice; give each remedy at most once")
            seen.add(key)
            kind = TRANSFORMS.get(key)
            if kind is None:
                raise unknown_choice(f"remedy in {raw!r}", mod, REMEDIES)
            try:
                transforms.append(kind.parse(value))
            except FFNQuantError as exc:
                raise FFNQuantError(f"scheme {raw!r}: {exc}") from None
        try:
            return cls(scheme, calibrator, transforms=transforms)
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
